"""The zoo's names as data: every registered architecture's name, family, aliases and one-line description.

This table is what ``slabconv list``, the ``--arch`` check of an unknown name and the shell completion of
``--arch`` read. It imports neither torch nor the model code, so those answer in a fraction of a second; the
family modules (``slabconv.zoo.deit``, ...) register the builders of the same names (``register_family`` takes a
preset's aliases and description from here, and refuses a name this table does not list).
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass

from slabconv.errors import UnsupportedModelError


@dataclass(frozen=True)
class ArchName:
    """One registered architecture, as ``slabconv list`` shows it.

    Attributes:
        name: the canonical name (the official release file stem): what ``--arch`` takes, case ignored.
        family: the model family (``deit``, ``swin``, ...), the module of ``slabconv.zoo`` that builds it.
        aliases: other accepted names (official README names, registered ``MODEL.NAME`` names).
        description: one line for ``slabconv list``.
    """

    name: str
    family: str
    aliases: tuple[str, ...]
    description: str


_CSWIN_HOW = "LinearNorm norms, SLA stages 1-2, cross-shaped windows stages 3-4, 224x224"
_SWIN_HOW = "LinearNorm norms, SLA stages 1-2 (window 56), window 7 stages 3-4, 224x224"

NAMES: tuple[ArchName, ...] = (
    ArchName(
        "slab_cswin_tiny",
        "cswin",
        ("slab_cswin_t", "SLAB_CSWin_tiny", "SLAB_CSWin_64_24181_tiny_224"),
        f"SLAB-CSWin-T, {_CSWIN_HOW}",
    ),
    ArchName(
        "slab_cswin_small",
        "cswin",
        ("slab_cswin_s", "SLAB_CSWin_small", "SLAB_CSWin_64_24322_small_224"),
        f"SLAB-CSWin-S, {_CSWIN_HOW}",
    ),
    ArchName(
        "slab_cswin", "cswin", ("slab_cswin_custom",), "SLAB-CSWin of another size, read from the weights and config"
    ),
    ArchName(
        "deit_tiny_prepbn",
        "deit",
        ("deit_t_prepbn", "deit_tiny_patch16_224_repbn"),
        "DeiT-Tiny, RepBN norms, cls-token head, 224x224",
    ),
    ArchName(
        "deit_small_prepbn",
        "deit",
        ("deit_s_prepbn", "deit_small_patch16_224_repbn"),
        "DeiT-Small, LinearNorm(LayerNorm->RepBN) norms, cls-token head, 224x224",
    ),
    ArchName(
        "deit_prepbn",
        "deit",
        ("deit_custom_prepbn",),
        "DeiT of another size with PRepBN norms (e.g. the digits fixture), sizes read from the weights",
    ),
    ArchName(
        "llama_350m_prepbn",
        "llama",
        ("llama-350M", "llama_350m", "llama350m_prepbn"),
        "LLaMA-350M, LinearNorm(RMSNorm->RepBN) norms, causal LM on int64 token ids (B, T)",
    ),
    ArchName(
        "llama_prepbn",
        "llama",
        ("llama_custom_prepbn",),
        "LLaMA of another size with PRepBN norms (e.g. the text fixture); sizes from weights and config.json",
    ),
    *(
        ArchName(
            model_type,
            "llama_std",
            (cls,),
            f"standard {shown} causal LM (RMSNorm; no SLAB norms): folds with --fold-norm-affine; int64 token ids "
            "(B, T)",
        )
        for model_type, cls, shown in (
            ("llama", "LlamaForCausalLM", "LLaMA"),
            ("mistral", "MistralForCausalLM", "Mistral"),
            ("qwen2", "Qwen2ForCausalLM", "Qwen2"),
        )
    ),
    *(
        ArchName(
            f"pvt_{size}_prepbn",
            "pvt",
            (f"pvt_{size[0]}_prepbn",),
            f"PVT-{size.title()}, LinearNorm norms, spatial-reduction attention, 224x224",
        )
        for size in ("tiny", "small", "medium")
    ),
    *(
        ArchName(
            f"slab_pvt_{size}",
            "pvt",
            (f"slab_pvt_{size[0]}",),
            f"SLAB-PVT-{size.title()}, LinearNorm norms, SLA in every stage, 224x224",
        )
        for size in ("tiny", "small", "medium")
    ),
    ArchName(
        "pvt_prepbn",
        "pvt",
        ("slab_pvt", "pvt_custom_prepbn"),
        "PVT / SLAB-PVT of another size with PRepBN norms, read from the weights",
    ),
    ArchName(
        "slab_deit_tiny",
        "slab_deit",
        ("slab_deit_t", "deit_tiny_patch16_224_linear_repbn"),
        "SLAB-DeiT-Tiny: SLA, LinearNorm(LayerNorm->RepBN) norms, mean-pooled head, 224x224",
    ),
    ArchName(
        "slab_deit_small",
        "slab_deit",
        ("slab_deit_s", "deit_small_patch16_224_linear_repbn"),
        "SLAB-DeiT-Small: SLA, LinearNorm(LayerNorm->RepBN) norms, mean-pooled head, 224x224",
    ),
    ArchName("slab_deit", "slab_deit", ("slab_deit_custom",), "SLAB-DeiT of another size, sizes read from the weights"),
    ArchName(
        "swin_tiny_prepbn",
        "swin",
        ("swin_t_prepbn", "swin_tiny_repbn"),
        "Swin-T, RepBN norms, shifted-window attention (window 7), 224x224",
    ),
    *(
        ArchName(
            f"slab_swin_{size}",
            "swin",
            (f"slab_swin_{size[0]}", f"slab_swin_{size}_patch4_224"),
            f"SLAB-Swin-{size[0].upper()}, {_SWIN_HOW}",
        )
        for size in ("tiny", "small", "base")
    ),
    ArchName(
        "swin_prepbn",
        "swin",
        ("slab_swin", "swin_custom_prepbn"),
        "Swin / SLAB-Swin of another size with PRepBN norms, read from the weights and config",
    ),
)
"""Every registered architecture, in the order ``slabconv list`` prints them (by family)."""

BY_NAME: dict[str, ArchName] = {entry.name: entry for entry in NAMES}

ALIASES: dict[str, str] = {key: entry.name for entry in NAMES for key in (entry.name, *entry.aliases)}
"""Every accepted spelling (names and aliases, as written) -> the canonical name."""


def canonical(name: str) -> str | None:
    """The canonical name for ``name`` or one of its aliases; case is ignored when no spelling matches exactly."""
    if name in ALIASES:
        return ALIASES[name]
    return next((canon for key, canon in ALIASES.items() if key.casefold() == name.casefold()), None)


def complete_names(incomplete: str) -> list[str]:
    """Shell completion of ``--arch``: every name and alias that starts with ``incomplete`` (case ignored), names
    first. Each keeps what was typed as its start (names are case-blind, and a shell offers only candidates that
    start with the word as typed): ``DEIT_T`` completes to ``DEIT_TINY_PREPBN``, ``deit_t`` to ``deit_tiny_prepbn``."""
    names = [*BY_NAME, *(alias for alias in ALIASES if alias not in BY_NAME)]
    found = [name for name in names if name.casefold().startswith(incomplete.casefold())]
    if incomplete and incomplete.isupper():
        return list(dict.fromkeys(name.upper() for name in found))
    return list(dict.fromkeys(incomplete + name[len(incomplete) :] for name in found))


def close_names(name: str, n: int = 3) -> list[str]:
    """The names and aliases closest to ``name`` (``difflib``; case is ignored), best first."""
    by_lower: dict[str, str] = {}
    for key in ALIASES:
        by_lower.setdefault(key.lower(), key)
    return [by_lower[k] for k in difflib.get_close_matches(name.lower(), list(by_lower), n=n, cutoff=0.6)]


def unknown_arch_message(name: str) -> str:
    """``unknown architecture 'NAME'``, the closest names if any, and where the full list is."""
    close = close_names(name)
    if close:
        options = close[0] if len(close) == 1 else f"{', '.join(close[:-1])} or {close[-1]}"
        return f"unknown architecture {name!r}; did you mean {options}? (`slabconv list` shows every name)"
    return f"unknown architecture {name!r}; `slabconv list` shows every name"


def check_name(name: str) -> str:
    """The canonical name of ``name`` (an ``--arch`` value), checked against the table alone (nothing imported).

    Raises:
        UnsupportedModelError: no name or alias matches (the message gives the closest ones).
    """
    canon = canonical(name)
    if canon is None:
        raise UnsupportedModelError(unknown_arch_message(name))
    return canon
