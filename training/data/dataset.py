"""The training dataset: encoded once, cached on disk, served as deterministic single-bucket batches.

Every image is encoded once into a latent and every distinct caption once into (context, pooled). With
a cache_dir these go to disk as safetensors keyed by what determines them:
    latent: sha256(file bytes; image_hashes.py) + image encoder cache_id + bucket resolution + preprocessing version
    text:   caption + text encoder cache_id
so a second run (or a resumed one) skips encoding, and an edited image or caption gets a new key. The
dataset then keeps only paths and reads each tensor when a batch needs it, so a large T5 context per
caption costs disk, not RAM. Without a cache_dir everything stays in memory. Old entries stay too: cache_files.py
marks the entries each load and each read uses, and prunes what none used for a while (`tightrope cache`).

Batches: the epoch order is a pure function of (seed, epoch) and every epoch has the same number of
steps, so a run resumed at step S regenerates exactly the batches it would have seen.
"""
from __future__ import annotations

import copy
import hashlib
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from ..state.atomic_write import atomic_save_file
from .batching import EpochBatches
from .buckets import choose_bucket, fit_to_bucket
from .encoders import ImageEncoder, TextEncoder
from ..finite_check import check_finite
from .cache_files import cached_shapes as _cached_shapes, entry_path, read_entry
from .folder_warnings import warn_duplicates
from .header_checks import warn_from_headers
from .image_hashes import ImageHashes
from .image_folder import (DEFAULT_MAX_IMAGE_PIXELS, DatasetError, ImageHeader, folder_path, image_to_tensor,
                           load_image, no_usable_images, scan_folder, skip_or_raise)
from .keys import content_key as _sha256
from .masks import MASK_VERSION, MaskSource, find_masks, latent_mask
from .video_clips import ClipEncoding, ClipSettings, check_video_masks, is_video

# Bump when resizing/cropping/conversion changes, so old cached latents stop matching.
PREPROCESS_VERSION = "fit-lanczos-center-v1"
_TEXT_BATCH = 32  # captions per text-encoder call


@dataclass
class _Sample:
    """One distinct image. `latent` is the tensor, or the cache file that holds it."""
    latent: Tensor | Path
    shape: tuple[int, ...]
    caption: str
    text: int  # index into the dataset's text store
    mask: Tensor | Path | None = None  # (1, h, w) loss weights on the latent grid, or the cache file (= latent's)


def _load(x: Tensor | Path, name: str) -> Tensor:
    return x if isinstance(x, Tensor) else _load_cached(x)[name]


def _load_cached(path: Path) -> dict[str, Tensor]:
    """A cache file's tensors, checked: a NaN read here would surface steps later as a NaN loss."""
    tensors = read_entry(path)  # marked in use while it trains: `tightrope cache --older-than` keeps it
    check_finite(tensors, f"dataset cache file '{path}'", "it is damaged: delete it (or the whole cache folder) and "
                 "run again, so its image or caption is encoded again")
    return tensors


def _cpu(x: Tensor) -> Tensor:
    return x.detach().to("cpu").contiguous()


class TrainingDataset(EpochBatches, ClipEncoding):
    """Encoded images + caption embeddings, batched by bucket (batching.py).

    Counters for checking the cache: encoded_images / image_cache_hits, encoded_captions / caption_cache_hits,
    hashed_images / hashed_masks (read whole and hashed: the others' hashes came from the index), headers_read (image
    and mask headers read from their files: the others came from the index or the bytes hashed).
    """

    def __init__(self, folder: str | Path, image_encoder: ImageEncoder, text_encoder: TextEncoder, *,
                 max_pixels: int = 512 * 512, multiple: int | None = None, use_repeats: bool = True,
                 caption_dropout: float = 0.0, cache_dir: str | Path | None = None, strict: bool = True,
                 max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS, mask: str = "none",
                 progress: Callable[[int, int], None] | None = None, clips: ClipSettings | None = None):
        """multiple: bucket sides are multiples of this; default downscale * 2 (a patch-2 transformer
        like Flux). use_repeats=False ignores kohya N_name repeat counts. mask: 'none', 'mask_files' or 'alpha'
        (training/masks.py): a loss mask per image, cached with its latent. progress(done, total) after each image
        (a ComfyUI progress bar); what it raises (an interrupt) stops the encoding, and the images encoded so far
        stay in the cache. clips: how video files become samples (video_clips.py; default ClipSettings())."""
        downscale = int(image_encoder.downscale)
        multiple = downscale * 2 if multiple is None else multiple
        if multiple < 1 or multiple % downscale:
            raise ValueError(f"multiple={multiple} must be a positive multiple of the image encoder's downscale "
                             f"({downscale}), or every latent side would not be a whole number")
        self._init_common(caption_dropout)
        self.cache_dir = Path(cache_dir) if cache_dir is not None else None
        self.encoded_images = self.image_cache_hits = 0
        self.encoded_captions = self.caption_cache_hits = 0

        entries = scan_folder(folder, strict=strict, use_repeats=use_repeats)
        check_video_masks(entries, mask)
        # each file's sha256 and header from the last load where the file is unchanged (then it is not opened)
        hashes = ImageHashes(self.cache_dir)
        masks = find_masks(entries, mask, max_image_pixels, hashes)  # mask problems fail here, before any encoding
        self.hashed_masks = hashes.hashed
        clips, count = self._clip_plan(entries, image_encoder, clips)
        # the empty caption only where dropout uses it: an encoder that does not pad gives it its own length
        captions = sorted({e.caption for e in entries} | ({""} if caption_dropout > 0 else set()))
        # reported as 0 images done after each call: the captions come first, and the report is where an interrupt
        # (ComfyUI's Cancel) stops the work; a caption encoded before it stays in the cache
        text_index = self._encode_captions(captions, text_encoder,
                                           None if progress is None else lambda: progress(0, len(entries)))
        self._empty_text = text_index.get("")

        # from the images' headers, before any encoding: an upscale that large makes latents that large too
        headers = warn_from_headers(entries, hashes, max_pixels, multiple, max_image_pixels)
        samples, repeats, problems, copies = [], [], [], {}  # copies: the images' sha256 -> (path, repeats)
        for k, entry in enumerate(entries):
            if progress is not None and k:
                progress(k, len(entries))
            try:
                if is_video(entry.path):
                    latent, shape, weights, digest = self._encode_clip(entry.path, image_encoder, max_pixels, multiple,
                                                                       max_image_pixels, hashes, clips, count)
                else:
                    latent, shape, weights, digest = self._encode_image(entry.path, image_encoder, max_pixels, multiple,
                                                                        max_image_pixels, masks.get(entry.path),
                                                                        hashes, headers.get(entry.path))
            except DatasetError as e:
                skip_or_raise(e, strict)
                problems.append(e)
                continue
            samples.append(_Sample(latent, shape, entry.caption, text_index[entry.caption], weights))
            repeats.append(entry.repeats if use_repeats else 1)
            copies.setdefault(digest, []).append((entry.path, repeats[-1]))
        if progress is not None:
            progress(len(entries), len(entries))
        if not samples:
            raise no_usable_images(folder_path(folder), len(entries), problems)
        warn_duplicates(copies)  # from the hashes the cache keys need: no image is read for it
        hashes.save(folder_path(folder))
        self.hashed_images, self.headers_read = hashes.hashed - self.hashed_masks, hashes.headers_read
        self._finish(samples, repeats)

    @classmethod
    def from_tensors(cls, latents: list[Tensor], contexts: list[Tensor], pooled: list[Tensor], *,
                     captions: list[str] | None = None, empty_context: Tensor | None = None,
                     empty_pooled: Tensor | None = None, caption_dropout: float = 0.0,
                     repeats: list[int] | None = None) -> TrainingDataset:
        """From already-encoded tensors (ComfyUI's LATENT and CONDITIONING lists): latents (C, h, w) or video
        latents (C, frames, h, w) (one frame: an image's), contexts (T, D), pooled (P), each optionally with a leading
        batch dim of 1. Caption dropout
        needs the empty caption's encoding as empty_context / empty_pooled."""
        n = len(latents)
        if n == 0:
            raise DatasetError("from_tensors got no latents: pass at least one encoded image")
        captions = [""] * n if captions is None else list(captions)
        repeats = [1] * n if repeats is None else list(repeats)
        for name, values in (("contexts", contexts), ("pooled", pooled), ("captions", captions), ("repeats", repeats)):
            if len(values) != n:
                raise DatasetError(f"from_tensors got {n} latents but {len(values)} {name}: pass one per latent")
        if any(r < 1 for r in repeats):
            raise DatasetError(f"from_tensors got repeats {repeats}: every repeat count must be at least 1")
        if caption_dropout > 0 and (empty_context is None or empty_pooled is None):
            raise DatasetError(f"caption_dropout={caption_dropout} needs the empty caption's encoding: pass "
                               f"empty_context and empty_pooled (encode the caption \"\"), or set caption_dropout=0")

        def unbatch(x: Tensor, ndim: int, what: str, video: bool = False) -> Tensor:
            if x.ndim in (ndim + 1, ndim + 1 + video) and x.shape[0] == 1:  # a latent's channels are never 1
                x = x[0]
            if video and x.ndim == ndim + 1 and x.shape[1] == 1:  # a single frame: an image's latent
                x = x[:, 0]
            if x.ndim != ndim and not (video and x.ndim == ndim + 1):
                raise DatasetError(f"from_tensors: a {what} has shape {tuple(x.shape)}, expected {ndim} dims "
                                   f"(or {ndim + 1} with a leading batch of 1): pass one item per list entry")
            return _cpu(x)

        self = cls.__new__(cls)
        self._init_common(caption_dropout)
        self.cache_dir = None
        self.encoded_images = self.image_cache_hits = self.encoded_captions = self.caption_cache_hits = 0
        self._texts = [(unbatch(c, 2, "context"), unbatch(p, 1, "pooled")) for c, p in zip(contexts, pooled)]
        if empty_context is not None and empty_pooled is not None:
            self._texts.append((unbatch(empty_context, 2, "context"), unbatch(empty_pooled, 1, "pooled")))
            self._empty_text = len(self._texts) - 1
        else:
            self._empty_text = None
        self._text_shapes = [(c.shape, p.shape) for c, p in self._texts]
        samples = []
        for i, (latent, caption) in enumerate(zip(latents, captions)):
            latent = unbatch(latent, 3, "latent", video=True)
            samples.append(_Sample(latent, tuple(latent.shape), caption, i))
        self._finish(samples, repeats)
        return self

    # -- construction helpers ------------------------------------------------------------------------

    def _init_common(self, caption_dropout: float) -> None:
        if not 0.0 <= caption_dropout <= 1.0:
            raise ValueError(f"caption_dropout must be between 0 and 1, got {caption_dropout}")
        self.caption_dropout = float(caption_dropout)
        self._texts: list[tuple[Tensor, Tensor] | Path] = []
        self._text_shapes: list[tuple[tuple[int, ...], tuple[int, ...]]] = []

    def _encode_captions(self, captions: list[str], encoder: TextEncoder,
                         encoded: Callable[[], None] | None = None) -> dict[str, int]:
        """Fill the text store, from the cache where possible; returns caption -> store index. encoded() after each
        encoder call (what it raises stops the encoding)."""
        index, missing = {}, []
        for caption in captions:
            path = self._cache_path("text", _sha256(caption, encoder.cache_id))
            shapes = _cached_shapes(path, ("context", "pooled")) if path else None
            index[caption] = len(self._texts)
            if shapes:
                self.caption_cache_hits += 1
                self._texts.append(path)
                self._text_shapes.append((shapes["context"], shapes["pooled"]))
            else:
                self._texts.append(None)  # filled below
                self._text_shapes.append(None)
                missing.append(caption)
        with torch.no_grad():
            per_call = getattr(encoder, "captions_per_call", _TEXT_BATCH)  # 1 for encoders that do not pad
            for start in range(0, len(missing), per_call):
                chunk = missing[start:start + per_call]
                context, pooled = encoder.encode(chunk)
                for caption, c, p in zip(chunk, _cpu(context), _cpu(pooled)):
                    i, c, p = index[caption], c.clone(), p.clone()
                    path = self._cache_path("text", _sha256(caption, encoder.cache_id))
                    if path:
                        atomic_save_file({"context": c, "pooled": p}, path)
                    self._texts[i] = path or (c, p)
                    self._text_shapes[i] = (tuple(c.shape), tuple(p.shape))
                    self.encoded_captions += 1
                if encoded is not None:
                    encoded()
        return index

    def _encode_image(self, path: Path, encoder: ImageEncoder, max_pixels: int, multiple: int, max_image_pixels: int,
                      mask: MaskSource | None, hashes: ImageHashes, header: ImageHeader | None = None,
                      trust: bool = True) -> tuple[Tensor | Path, tuple[int, ...], Tensor | Path | None, str]:
        """(latent, its shape, its loss mask) as tensors or their cache file, and the sha256 of the image file. header:
        the image's, if known already (else read here). The file is read only if the index lacks its hash."""
        digest, data = hashes.digest(path, trust=trust)  # data None: the index knew the hash; nothing was read
        if data is not None or header is None:  # from the bytes hashed, recorded with their hash
            header = hashes.header(path, max_image_pixels, data=data)
        bucket = choose_bucket(*header.size, max_pixels, multiple)
        key = _sha256(digest, encoder.cache_id, f"{bucket[0]}x{bucket[1]}", PREPROCESS_VERSION)
        if mask is not None:  # the mask is cached with the latent; without one the key stays as it was
            key = _sha256(key, mask.cache_key, MASK_VERSION)
        cache_path = self._cache_path("latents", key)
        shapes = _cached_shapes(cache_path, ("latent",) if mask is None else ("latent", "mask")) \
            if cache_path else None
        if shapes:
            self.image_cache_hits += 1
            return cache_path, shapes["latent"], None if mask is None else cache_path, digest
        if data is None:  # to be encoded: from the bytes read and hashed now, under their own key
            return self._encode_image(path, encoder, max_pixels, multiple, max_image_pixels, mask, hashes, trust=False)
        image = fit_to_bucket(load_image(path, data=data, max_pixels=max_image_pixels), bucket)
        with torch.no_grad():
            latent = _cpu(encoder.encode(image_to_tensor(image)[None])[0]).clone()
        self.encoded_images += 1
        weights = None if mask is None else latent_mask(mask, bucket, int(encoder.downscale), max_image_pixels)
        if weights is not None and weights.shape[1:] != latent.shape[1:]:
            raise DatasetError(f"the mask of '{path}' came out {tuple(weights.shape[1:])} but its latent is "
                               f"{tuple(latent.shape[1:])}: the image encoder's downscale does not match its latents")
        if cache_path:
            atomic_save_file({"latent": latent} | ({} if weights is None else {"mask": weights}), cache_path)
            return cache_path, tuple(latent.shape), None if weights is None else cache_path, digest
        return latent, tuple(latent.shape), weights, digest

    def _cache_path(self, kind: str, key: str) -> Path | None:
        return entry_path(self.cache_dir, kind, key) if self.cache_dir else None

    def _finish(self, samples: list[_Sample], repeats: list[int]) -> None:
        used = {self._text_shapes[i] for i in {s.text for s in samples} | {self._empty_text} - {None}}
        widths = {(context[1:], pooled) for context, pooled in used}
        if len(widths) > 1:
            raise DatasetError(f"caption embeddings differ in width ({sorted(widths)}): every caption must come from "
                               "the same text encoder")
        self._samples = samples
        # An item is one appearance of a sample in an epoch; repeats make several.
        self._items = [i for i, r in enumerate(repeats) for _ in range(r)]
        buckets: dict[tuple[tuple[int, ...], tuple[int, ...]], list[int]] = {}
        for item, sample in enumerate(self._items):
            key = (self._samples[sample].shape, tuple(self._text_shapes[self._samples[sample].text][0]))
            buckets.setdefault(key, []).append(item)
        self._buckets = dict(sorted(buckets.items()))

    def subset(self, images: list[int]) -> TrainingDataset:
        """A dataset of the distinct images `images` (with their repeats), sharing this one's tensors and cache."""
        part, repeats = copy.copy(self), Counter(self._items)
        part._finish([self._samples[i] for i in images], [repeats[i] for i in images])
        return part

    # -- access --------------------------------------------------------------------------------------
    def __len__(self) -> int:
        """Items per epoch, after repeats."""
        return len(self._items)

    @property
    def num_images(self) -> int:
        return len(self._samples)

    @property
    def bucket_counts(self) -> dict[tuple[int, ...], int]:
        """Latent shape -> items (after repeats) of that shape."""
        return dict(Counter(self._samples[self._items[i]].shape for items in self._buckets.values() for i in items))

    def latent(self, index: int) -> Tensor:
        """The latent of distinct image `index` (0 <= index < num_images)."""
        return _load(self._samples[index].latent, "latent")

    def latent_shape(self, index: int) -> tuple[int, ...]:
        """The latent shape of distinct image `index`, without reading it (a cache file each)."""
        return tuple(self._samples[index].shape)

    def mask(self, index: int) -> Tensor | None:
        """The loss mask (1, h, w) of distinct image `index` on its latent grid; None without masks."""
        mask = self._samples[index].mask
        return None if mask is None else _load(mask, "mask")

    def cache_files(self) -> set[Path]:
        """The cache entries this dataset reads (none without a cache_dir)."""
        texts = {s.text for s in self._samples} | ({self._empty_text} if self._empty_text is not None else set())
        return {x for x in [s.latent for s in self._samples] + [self._texts[i] for i in texts] if isinstance(x, Path)}

    def caption(self, index: int) -> str:
        return self._samples[index].caption

    def content_digest(self) -> str:
        """A hash of everything a step reads, exactly: each image's latent and loss mask and its caption's text
        encoding (a cache file by its path, whose name is the hash of what made it; a tensor by its bytes, once per
        tensor object: a LATENT's rows, a CONDITIONING shared by all images), in sample order."""
        h, seen = hashlib.sha256(), {}

        def add(x) -> None:
            if isinstance(x, Path):
                h.update(f"file {x.name};".encode())
            elif x is None:
                h.update(b"none;")
            elif isinstance(x, tuple):
                for part in x:
                    add(part)
            elif id(x) in seen:
                h.update(f"again {seen[id(x)]};".encode())
            else:
                seen[id(x)] = len(seen)
                t = x.detach().to("cpu").contiguous()
                h.update(f"{t.dtype}{tuple(t.shape)};".encode() + t.reshape(-1).view(torch.uint8).numpy().tobytes())
        for sample in self._samples:
            h.update(sample.caption.encode() + b"\0")
            add(sample.latent), add(sample.mask), add(self._texts[sample.text])
        add(None if self._empty_text is None else self._texts[self._empty_text])
        return h.hexdigest()

    def text(self, index: int) -> tuple[Tensor, Tensor]:
        """(context, pooled) of distinct image `index`'s caption."""
        return self._text(self._samples[index].text)

    def encoded_widths(self) -> tuple[set[int], set[int], set[int]]:
        """The latent channel counts, the caption contexts' widths and the pooled embeddings' widths in use (the
        VAE's and the text encoders' output widths), read from shapes only: what a model's input layers must take."""
        texts = {s.text for s in self._samples} | ({self._empty_text} if self._empty_text is not None else set())
        return ({s.shape[0] for s in self._samples}, {self._text_shapes[i][0][-1] for i in texts},
                {(self._text_shapes[i][1] or (0,))[-1] for i in texts})

    def clip_count(self) -> int:
        """How many distinct samples are video clips (latents (C, frames, h, w)), from shapes only."""
        return sum(len(s.shape) == 4 for s in self._samples)

    def text_shape(self, index: int) -> tuple[int, ...]:
        """The context shape (T, D) of distinct image `index`'s caption, without reading it."""
        return tuple(self._text_shapes[self._samples[index].text][0])

    def empty_text(self) -> tuple[Tensor, Tensor]:
        if self._empty_text is None:
            raise DatasetError("this dataset has no empty-caption encoding: build it with empty_context/empty_pooled")
        return self._text(self._empty_text)

    def _text(self, i: int) -> tuple[Tensor, Tensor]:
        entry = self._texts[i]
        if isinstance(entry, Path):
            tensors = _load_cached(entry)
            return tensors["context"], tensors["pooled"]
        return entry

    def _stored(self, sample: _Sample) -> tuple[Tensor, Tensor | None]:
        """(latent, loss mask or None) of a sample, with one read of its cache file for both."""
        stored = _load_cached(sample.latent) if isinstance(sample.latent, Path) else None
        latent = stored["latent"] if stored else sample.latent
        return latent, None if sample.mask is None else (stored["mask"] if stored else sample.mask)
