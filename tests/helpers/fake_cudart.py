"""A CUDA runtime's host-registration rules, modelled for the CPU simulation (tests of host_pinning and layer_offload).

What the driver does, and the first H100 run showed (2026-11-23):
- cudaHostRegister pins whole pages; a range that overlaps one already registered is refused (712, already
  registered), and refusing sets the thread's last error.
- cudaHostUnregister takes the start of a registered range; anything else is refused (713, not registered).
- Read-only memory (a PROT_READ mapping, as ComfyUI's dynamic VRAM loads weights) registers only with
  cudaHostRegisterReadOnly (flag 8): the driver pins its pages for device reads only. Without it: 1, invalid argument.
  Where the GPU/driver lacks read-only registration (cudaDevAttrHostRegisterReadOnlySupported = 0, reported for a B300
  on driver 610 and an RTX PRO 6000 on 595), flag 8 gives 801, not supported (`read_only_supported=False`).
- A range the kernel pins only in part (os-mlock.c: fewer pages pinned than asked, as FOLL_LONGTERM migration can
  leave them; large single registrations on driver 610) is refused as a whole with 1, invalid argument: `max_bytes`
  refuses every registration larger than it, `refuse_at` the ones starting at the given addresses.
- A copy whose host buffer lies partly inside a registered range and partly outside fails ("invalid argument").
  `StraddleCheck` raises exactly there, for every copy the simulation makes, whichever side is the host.
"""
import mmap

import torch
from torch.utils._python_dispatch import TorchDispatchMode

ALREADY_REGISTERED, NOT_REGISTERED, INVALID_VALUE, READ_ONLY = 712, 713, 1, 8
OUT_OF_MEMORY, NOT_SUPPORTED = 2, 801
ERRORS = {INVALID_VALUE: "invalid argument", OUT_OF_MEMORY: "out of memory", NOT_SUPPORTED: "operation not supported",
          ALREADY_REGISTERED: "part or all of the requested memory range is already mapped",
          NOT_REGISTERED: "pointer does not correspond to a registered memory region"}


class FakeCudart:
    """torch.cuda.cudart()'s registration calls with the driver's rules; `refuse` (an error code) makes every
    registration fail, or only the first `refuse_first` of them; `read_only_supported=False`: flag 8 gives 801;
    `max_bytes`, `refuse_at` (start addresses): those registrations are pinned only in part, so refused (1)."""

    def __init__(self, refuse=0, page=mmap.PAGESIZE, refuse_first=None, *, read_only_supported=True, max_bytes=None,
                 refuse_at=()):
        self.refuse, self.page, self.refuse_first = refuse, page, refuse_first
        self.read_only_supported, self.max_bytes, self.refuse_at = read_only_supported, max_bytes, set(refuse_at)
        self.live: dict[int, int] = {}          # start -> nbytes, registered now
        self.registered, self.unregistered = [], []  # every successful call, in order
        self.flags: dict[int, int] = {}         # start -> the flags it was registered with

    def cudaHostRegister(self, ptr, nbytes, flags):
        if self.refuse and (self.refuse_first is None or self.refuse_first > 0):
            if self.refuse_first is not None:
                self.refuse_first -= 1
            return self.refuse
        if flags & READ_ONLY and not self.read_only_supported:
            return NOT_SUPPORTED
        if ptr in self.refuse_at or (self.max_bytes is not None and nbytes > self.max_bytes):
            return INVALID_VALUE
        a, b = ptr // self.page * self.page, -(-(ptr + nbytes) // self.page) * self.page
        if any(s < b and a < s + n for s, n in self.live.items()):
            return ALREADY_REGISTERED
        if not flags & READ_ONLY and not _writable(a, b):
            return INVALID_VALUE
        self.live[ptr], self.flags[ptr] = nbytes, flags
        self.registered.append((ptr, nbytes))
        return 0

    def cudaHostUnregister(self, ptr):
        if ptr not in self.live:
            return NOT_REGISTERED
        del self.live[ptr]
        self.unregistered.append(ptr)
        return 0

    def cudaError(self, code):
        return code

    def cudaGetErrorString(self, code):
        return ERRORS.get(code, "unknown error")

    def straddles(self, address: int, nbytes: int) -> bool:
        """Whether [address, address + nbytes) is partly inside some registered range and partly outside it."""
        end = address + nbytes
        for s, n in self.live.items():
            inside = max(0, min(end, s + n) - max(address, s))
            if 0 < inside < nbytes:
                return True
        return False


def _writable(a: int, b: int) -> bool:
    """Whether every mapping of this process that overlaps [a, b) may be written (/proc/self/maps)."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            lo, hi = (int(x, 16) for x in line.split(None, 1)[0].split("-"))
            if lo < b and a < hi and line.split()[1][1] != "w":
                return False
    return True


def _span(t: torch.Tensor) -> tuple[int, int]:
    return t.data_ptr(), t.numel() * t.element_size()


class StraddleCheck(TorchDispatchMode):
    """Raises "invalid argument" on a copy whose source or destination straddles a registered range, as the driver
    does; counts the copies that read wholly registered (`pinned_copies`) memory, and those of them made blocking
    (`blocking_pinned_copies`: each stalls the host until the copy stream has drained)."""

    def __init__(self, fake: FakeCudart):
        super().__init__()
        self.fake, self.pinned_copies, self.copies, self.blocking_pinned_copies = fake, 0, 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten.copy_.default, torch.ops.aten._to_copy.default):
            tensors = [a for a in args[:2] if isinstance(a, torch.Tensor) and a.device.type == "cpu"]
            for t in tensors:
                if t.is_contiguous() and self.fake.straddles(*_span(t)):
                    raise RuntimeError("CUDA error: invalid argument (a host buffer partly page-locked)")
            self.copies += 1
            src = args[1] if func is torch.ops.aten.copy_.default else args[0]
            address, nbytes = _span(src)
            if nbytes and any(s <= address and address + nbytes <= s + n for s, n in self.fake.live.items()):
                self.pinned_copies += 1
                if func is torch.ops.aten.copy_.default:
                    non_blocking = args[2] if len(args) > 2 else (kwargs or {}).get("non_blocking", False)
                    self.blocking_pinned_copies += not non_blocking
        return func(*args, **(kwargs or {}))
