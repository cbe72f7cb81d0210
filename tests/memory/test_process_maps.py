"""This process's mappings from /proc/self/maps (Linux)."""
import mmap
import os

import pytest

from tightrope.memory.process_maps import mappings

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="Linux only")


def test_a_mapped_file_whose_name_is_not_utf8_is_listed(tmp_path):
    """File names are bytes on Linux; one mapped from a folder named in Latin-1 made mappings() raise
    UnicodeDecodeError (host pinning, the host-RAM plan and shared weights read it during a run)."""
    path = os.path.join(os.fsencode(tmp_path), b"mod\xe8le.safetensors")
    with open(path, "wb") as f:
        f.write(b"\0" * mmap.PAGESIZE)
    fd = os.open(path, os.O_RDONLY)
    try:
        mapped = mmap.mmap(fd, mmap.PAGESIZE, prot=mmap.PROT_READ)
        try:
            assert os.fsdecode(path) in {m.path for m in mappings()}
        finally:
            mapped.close()
    finally:
        os.close(fd)
