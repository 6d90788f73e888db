"""What every kernel's tile configurations share: the config type, the table lookup,
the dtype-width and head-dim rules, and the one filter that fits candidates to the
BlockMask's blocks and to shared memory.

A kernel's configuration is a frozen dataclass deriving from ``TileConfig``; its
``OPTION_NAMES`` map each field to the kernel_options key that pins it (registered in
``flexattn.options``). A kernel's tables map (padded head-dim bucket, dtype width) to its
default, one table per GPU generation, and per GPU model where one measured differently
(``generation_table``: a model's table holds only the entries that differ).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, ClassVar, Sequence

import torch

from ... import options as _options

MIN_TILE = 16  # tl.dot needs every dimension >= 16


class ConfigError(ValueError):
    """kernel_options pin a tile configuration the call cannot use."""


class TileConfig:
    """What the kernels' frozen config dataclasses share: ``OPTION_NAMES`` maps each field
    to the kernel_options key that pins it, and ``OPTION_PREFIX`` (``fwd_``, ``bwd_``)
    spells a key that pins it for this kernel alone and wins over the unprefixed one."""

    OPTION_NAMES: ClassVar[dict[str, str]] = {}
    OPTION_PREFIX: ClassVar[str] = ""

    def describe(self) -> str:
        """The fields as kernel_options would pin them; a flag only when it is set."""
        parts = []
        for field, option in self.OPTION_NAMES.items():
            value = getattr(self, field)
            if isinstance(value, bool):
                parts += [option] if value else []
            else:
                parts.append(f"{option}={value}")
        return " ".join(parts)

    @classmethod
    def option_spellings(cls) -> list[str]:
        """Every kernel_options key that pins a field of this config."""
        prefixes = ("", cls.OPTION_PREFIX) if cls.OPTION_PREFIX else ("",)
        return [f"{prefix}{option}" for option in cls.OPTION_NAMES.values() for prefix in prefixes]

    @classmethod
    def pinned_fields(cls, kernel_options: dict[str, Any]) -> dict[str, Any]:
        """The fields kernel_options pin, keyed by field name (flags as bool, the rest int)."""
        flags = {f.name for f in dataclasses.fields(cls) if f.type in ("bool", bool)}
        pinned: dict[str, Any] = {}
        for field, option in cls.OPTION_NAMES.items():
            spellings = (option, f"{cls.OPTION_PREFIX}{option}") if cls.OPTION_PREFIX else (option,)
            for spelled in spellings:  # the prefixed spelling is read last and wins
                value = _options.read(kernel_options, spelled)
                if value is not None:
                    pinned[field] = bool(value) if field in flags else int(value)
        return pinned


#: Multiprocessors assumed where the device has none to ask (the Triton interpreter):
#: above the tile count of small test shapes, so those split as on a GPU.
VIRTUAL_SMS = 8


def multiprocessor_count(device: torch.device) -> int:
    """The device's SMs, or VIRTUAL_SMS where it has none to ask."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return VIRTUAL_SMS


def gpu_generation(device: torch.device) -> str:
    """The table a device reads: "sm90" (Hopper and newer), "sm80" (Ampere, Ada) or
    "generic" (any other device, CPU tensors in the Triton interpreter included)."""
    if device.type != "cuda" or torch.version.hip:
        return "generic"
    major, _ = torch.cuda.get_device_capability(device)
    if major >= 9:
        return "sm90"
    if major == 8:
        return "sm80"
    return "generic"


def gpu_model(device: torch.device) -> str | None:
    """The GPU model whose own table entries override its generation's: "h100" or
    "h200" (same sm90 generation, different memory bandwidth), else None."""
    if device.type != "cuda" or torch.version.hip:
        return None
    name = torch.cuda.get_device_name(device).upper()
    return next((model.lower() for model in ("H100", "H200") if model in name), None)


def head_dim_bucket(padded_head_dim: int) -> int:
    return 64 if padded_head_dim <= 64 else 128 if padded_head_dim <= 128 else 256


def dtype_width(dtype: torch.dtype) -> str:
    """The tables' dtype column: "16bit" for float16/bfloat16, "fp32" for wider types
    (float64, a correctness mode without tensor cores, takes the float32 tiles)."""
    return "16bit" if dtype in (torch.float16, torch.bfloat16) else "fp32"


def generation_table(tables: dict[str, dict[tuple[int, str], Any]], device: torch.device, padded_head_dim: int,
                     dtype: torch.dtype):
    """A kernel's default configuration for a call: its GPU model's table (``"sm90-h100"``)
    where that has the entry, else its generation's, at the head-dim bucket and dtype
    width."""
    entry = table_entry(tables, device, padded_head_dim, dtype)
    if entry is None:
        generation = gpu_generation(device)
        raise KeyError(f"no {generation} entry for head dim {padded_head_dim} and {dtype}")
    return entry


def table_entry(tables: dict[str, dict[tuple[int, str], Any]], device: torch.device, padded_head_dim: int,
                dtype: torch.dtype):
    """``generation_table``'s lookup for tables that hold only some entries (of some
    generations): the entry, or None where neither the model's nor the generation's
    table has one."""
    generation, key = gpu_generation(device), (head_dim_bucket(padded_head_dim), dtype_width(dtype))
    for name in (f"{generation}-{gpu_model(device)}", generation):
        if key in tables.get(name, {}):
            return tables[name][key]
    return None


def shared_memory_limit(device: torch.device) -> int | None:
    """Bytes of shared memory one program may use, or None where it is not known."""
    if device.type != "cuda":
        return None
    props = torch.cuda.get_device_properties(device)
    return getattr(props, "shared_memory_per_block_optin", None) or None


def with_pinned(configs: Sequence[TileConfig], pinned: dict[str, Any]) -> list:
    """``configs`` with the pinned fields replaced, duplicates dropped (order kept)."""
    out: list = []
    for cfg in configs:
        cfg = dataclasses.replace(cfg, **pinned)
        if cfg not in out:
            out.append(cfg)
    return out


def check_pinned(pinned: dict[str, Any], tile_limits: dict[str, tuple[str, str, int]], prefix: str = "") -> None:
    """Raise ConfigError for a pinned tile that is not a power of two >= MIN_TILE dividing
    its BlockMask block size, or a pinned num_warps / num_stages below 1.
    ``tile_limits``: field -> (its kernel_options name, "Q" or "KV", the block size);
    ``prefix`` is put before the names in the messages."""
    for field, (option, which, limit) in tile_limits.items():
        if field in pinned:
            value = pinned[field]
            if value < MIN_TILE or value & (value - 1) or limit % value:
                raise ConfigError(
                    f"flexattn: kernel_options {prefix}{option}={value} must be a power of two >= {MIN_TILE} "
                    f"that divides the BlockMask's {which}_BLOCK_SIZE={limit}")
    for field in ("num_warps", "num_stages"):
        if field in pinned and pinned[field] < 1:
            raise ConfigError(f"flexattn: kernel_options {prefix}{field}={pinned[field]} must be >= 1")


def fit_tiles(cfg, limits: dict[str, int]):
    """``cfg`` with each tile field in ``limits`` halved until it divides its limit (the
    BlockMask's block size); None when one cannot."""
    fitted = {}
    for field, limit in limits.items():
        value = getattr(cfg, field)
        while value > MIN_TILE and limit % value:
            value //= 2
        if limit % value:
            return None
        fitted[field] = value
    return dataclasses.replace(cfg, **fitted)


def fit_to_shared_memory(cfg, estimate, limit: int | None, pinned: dict[str, int], steps):
    """Step ``cfg`` down until ``estimate(cfg) <= limit``: each of ``steps`` (field,
    floor) in turn, fields the user pinned excepted; num_stages drops by one, tiles
    halve. None when nothing fits."""
    if limit is None:
        return cfg
    for field, floor in steps:
        while estimate(cfg) > limit and field not in pinned and getattr(cfg, field) > floor:
            value = getattr(cfg, field)
            cfg = dataclasses.replace(cfg, **{field: value - 1 if field == "num_stages" else value // 2})
    return cfg if estimate(cfg) <= limit else None


def fit_candidates(candidates: Sequence, *, block_limits: dict[str, int],
                   estimate: Callable[[Any], int] | None = None, smem_limit: int | None = None,
                   pinned: dict[str, Any] | None = None, steps=()) -> list:
    """The one filter of every kernel's candidates: each fitted to the BlockMask's blocks
    (``fit_tiles``) and then, given an ``estimate``, to shared memory
    (``fit_to_shared_memory`` with ``steps``); those that cannot be dropped, duplicates
    too."""
    usable: list = []
    for cfg in candidates:
        fitted = fit_tiles(cfg, block_limits)
        if fitted is not None and estimate is not None:
            fitted = fit_to_shared_memory(fitted, estimate, smem_limit, pinned or {}, steps)
        if fitted is not None and fitted not in usable:
            usable.append(fitted)
    return usable


def no_config_error(kernel: str, candidates: Sequence, *, sparse_q: int | None, sparse_kv: int,
                    qk_dim_pad: int, v_dim_pad: int, smem_limit: int | None) -> ConfigError:
    blocks = f"Q={sparse_q}, KV={sparse_kv}" if sparse_q is not None else f"KV={sparse_kv}"
    return ConfigError(
        f"flexattn: no {kernel} tile configuration fits this call (BlockMask block sizes "
        f"{blocks}; padded head dims {qk_dim_pad}/{v_dim_pad}; "
        f"shared memory limit {smem_limit}); candidates were "
        f"{[c.describe() for c in candidates]}. Block sizes must be multiples of {MIN_TILE}.")
