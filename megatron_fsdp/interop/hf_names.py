"""Name maps between a model's parameters and a Hugging Face checkpoint's tensors.

A ``NameMap`` says, for each of our parameter names, which checkpoint tensors compose it:
``Piece``s stacked along dim 0, in order. One piece is a rename (norms, embeddings); several
are a fused projection (the embedded GPT's QKV ``[q | k | v]``, its swiglu ``fc``
``[gate | up]``); a transposed piece is stored (columns, rows) in the file (GPT-2's
``Conv1D``). Rows of ours past the pieces are vocabulary padding (``padded``): zeros on load,
dropped on save. Tied names (``tied``) share another name's value and are neither read nor
written on their own.

[Note: rotary layout] Our RoPE without ``rotary_interleaved`` pairs channel j with j + d/2
and turns pair j by position * base^(-2j/d) (models/rope.py); ``transformers``' Llama,
Mistral, Qwen and Mixtral use the same rotate-half form (``rotate_half``, inverse frequencies
base^(-2j/d) on both halves). Query and key rows are therefore copied as they are, head
after head, with no permutation (Megatron-LM's HF converters permute only into its
interleaved layout).

[Note: Mixtral experts on disk] ``transformers`` 5 holds Mixtral's experts fused
(``mlp.experts.gate_up_proj`` (E, 2f, h), ``down_proj`` (E, h, f)) but converts on load from,
and saves back to, the per-expert layout every published Mixtral checkpoint uses:
``block_sparse_moe.experts.{e}.w1`` (gate), ``w3`` (up), ``w2`` (down) and
``block_sparse_moe.gate`` (the router). The map uses that on-disk layout.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable, Mapping, Optional

from ..models.config import GPTConfig, PositionEmbeddingType
from .hf_config import HFFamily


@dataclasses.dataclass(frozen=True)
class Piece:
    """One checkpoint tensor inside one of our parameters."""

    hf_name: str
    rows: Optional[int] = None
    """Rows of ours it fills (dim 0); ``None``: all of them (the only piece)."""
    transposed: bool = False
    """Stored transposed in the file: our rows are its columns (GPT-2's ``Conv1D``)."""


@dataclasses.dataclass(frozen=True)
class NameMap:
    """Our parameter names -> the checkpoint tensors that compose them (see the module docstring)."""

    entries: Mapping[str, tuple[Piece, ...]]
    """Our name -> its pieces along dim 0, in order."""
    tied: Mapping[str, str] = dataclasses.field(default_factory=dict)
    """Our name -> the name whose value it shares (the tied output layer)."""
    padded: frozenset = frozenset()
    """Our names whose rows past the pieces are vocabulary padding."""
    optional_hf: frozenset = frozenset()
    """Checkpoint tensors that may be present and go unused (a tied output layer saved
    anyway, GPT-2's attention-mask buffers)."""
    optional_prefix: str = ""
    """A prefix of the checkpoint names that a file may omit (GPT-2 files saved from
    ``GPT2Model`` name ``h.0...`` rather than ``transformer.h.0...``)."""
    family: Optional[HFFamily] = None
    """The family whose checkpoints the map reads (``None``: any, as the identity)."""

    def hf_names(self) -> list[str]:
        """Every checkpoint tensor the map reads, in our names' order."""
        return [piece.hf_name for pieces in self.entries.values() for piece in pieces]

    def spans(self, name: str, rows: int) -> list[tuple[Piece, int, int]]:
        """(piece, first row, end row) of each piece of ``name`` inside our ``rows`` rows;
        raises ``ValueError`` when the pieces need more rows than ours has, or fewer without
        ``name`` being padded."""
        pieces = self.entries[name]
        if len(pieces) == 1 and pieces[0].rows is None:
            return [(pieces[0], 0, rows)]
        out, start = [], 0
        for piece in pieces:
            if piece.rows is None:
                raise ValueError(f"{name}: piece {piece.hf_name} has no row count; only a lone piece may omit it")
            out.append((piece, start, start + piece.rows))
            start += piece.rows
        if start > rows or (start < rows and name not in self.padded):
            raise ValueError(f"{name}: the map's pieces {[p.hf_name for p in pieces]} fill {start} rows, the "
                             f"model's tensor has {rows}; the map was built for another configuration")
        return out


def identity_name_map(names: Iterable[str], *, tied: Mapping[str, str] | None = None) -> NameMap:
    """Each name is the checkpoint's own (a wrapped ``transformers`` model). ``tied``: our
    name -> the name it shares (``{"lm_head.weight": "model.embed_tokens.weight"}``);
    ``load_hf_checkpoint`` also finds tied names by value identity."""
    tied = dict(tied or {})
    return NameMap(entries={n: (Piece(n),) for n in names if n not in tied}, tied=tied,
                   optional_hf=frozenset(tied))


# -- the embedded GPT ----------------------------------------------------------------------------
def gpt_name_map(cfg: GPTConfig, family: HFFamily, *, vocab_size: int | None = None) -> NameMap:
    """The map between ``GPT(cfg)``'s parameters and a ``family`` checkpoint. ``vocab_size``:
    the checkpoint's vocabulary (default ``cfg.vocab_size``); our rows above it are padding."""
    family = HFFamily(family)
    vocab = cfg.vocab_size if vocab_size is None else vocab_size
    if vocab > cfg.vocab_size:
        raise ValueError(f"vocab_size={vocab} exceeds the model's vocab_size={cfg.vocab_size}; pad the model's "
                         "vocabulary (vocab_size_with_padding) to at least the checkpoint's")
    if family is HFFamily.GPT2:
        return _gpt2_map(cfg, vocab)
    entries: dict[str, tuple[Piece, ...]] = {"wte.weight": (Piece("model.embed_tokens.weight", vocab),)}
    for i in range(cfg.num_layers):
        entries.update(_gated_block(cfg, family, i))
    entries["ln_f.weight"] = (Piece("model.norm.weight"),)
    return _with_output(entries, cfg, family, vocab, padded={"wte.weight"})


def _with_output(entries: dict, cfg: GPTConfig, family: HFFamily, vocab: int, *, padded: set[str],
                 optional: Iterable[str] = (), prefix: str = "") -> NameMap:
    hf_output = "lm_head.weight"
    optional = set(optional)
    tied: dict[str, str] = {}
    if cfg.untie_embeddings_and_output_weights:
        entries["lm_head.weight"] = (Piece(hf_output, vocab),)
        padded = padded | {"lm_head.weight"}
    else:
        tied["lm_head.weight"] = "wte.weight"
        optional.add(hf_output)  # some tied checkpoints store the output layer anyway
    return NameMap(entries=entries, tied=tied, padded=frozenset(padded), optional_hf=frozenset(optional),
                   optional_prefix=prefix, family=family)


def _gated_block(cfg: GPTConfig, family: HFFamily, i: int) -> dict[str, tuple[Piece, ...]]:
    """One Llama-shaped block: fused QKV, swiglu MLP or Mixtral experts, RMSNorms."""
    ours, theirs = f"blocks.{i}", f"model.layers.{i}"
    q, kv = cfg.num_attention_heads * cfg.kv_channels, cfg.num_query_groups * cfg.kv_channels
    out = {f"{ours}.ln_1.weight": (Piece(f"{theirs}.input_layernorm.weight"),)}
    for kind in ("weight", "bias") if cfg.add_bias_linear or cfg.add_qkv_bias else ("weight",):
        out[f"{ours}.attn.qkv.{kind}"] = tuple(
            Piece(f"{theirs}.self_attn.{p}_proj.{kind}", rows) for p, rows in (("q", q), ("k", kv), ("v", kv)))
    out[f"{ours}.attn.proj.weight"] = (Piece(f"{theirs}.self_attn.o_proj.weight"),)
    if cfg.qk_layernorm:
        out[f"{ours}.attn.q_layernorm.weight"] = (Piece(f"{theirs}.self_attn.q_norm.weight"),)
        out[f"{ours}.attn.k_layernorm.weight"] = (Piece(f"{theirs}.self_attn.k_norm.weight"),)
    out[f"{ours}.ln_2.weight"] = (Piece(f"{theirs}.post_attention_layernorm.weight"),)
    if cfg.num_moe_experts and cfg.is_moe_layer(i):
        moe, ffn = f"{theirs}.block_sparse_moe", cfg.moe_ffn_hidden_size
        out[f"{ours}.mlp.router.weight"] = (Piece(f"{moe}.gate.weight"),)
        for e in range(cfg.num_moe_experts):
            expert = f"{moe}.experts.{e}"
            out[f"{ours}.mlp.experts.{e}.fc.weight"] = (Piece(f"{expert}.w1.weight", ffn),
                                                        Piece(f"{expert}.w3.weight", ffn))
            out[f"{ours}.mlp.experts.{e}.proj.weight"] = (Piece(f"{expert}.w2.weight"),)
        return out
    ffn = cfg.ffn_hidden_size
    out[f"{ours}.mlp.fc.weight"] = (Piece(f"{theirs}.mlp.gate_proj.weight", ffn),
                                    Piece(f"{theirs}.mlp.up_proj.weight", ffn))
    out[f"{ours}.mlp.proj.weight"] = (Piece(f"{theirs}.mlp.down_proj.weight"),)
    if cfg.add_bias_linear:  # Llama's attention_bias + mlp_bias
        out[f"{ours}.attn.proj.bias"] = (Piece(f"{theirs}.self_attn.o_proj.bias"),)
        out[f"{ours}.mlp.fc.bias"] = (Piece(f"{theirs}.mlp.gate_proj.bias", ffn),
                                      Piece(f"{theirs}.mlp.up_proj.bias", ffn))
        out[f"{ours}.mlp.proj.bias"] = (Piece(f"{theirs}.mlp.down_proj.bias"),)
    return out


def _gpt2_map(cfg: GPTConfig, vocab: int) -> NameMap:
    """GPT-2: LayerNorms with biases, learned positions, Conv1D weights stored (in, out)."""
    if cfg.position_embedding_type is not PositionEmbeddingType.LEARNED_ABSOLUTE:
        raise ValueError(f"position_embedding_type={cfg.position_embedding_type.value!r}: GPT-2 checkpoints have "
                         "learned positions; build the config with gpt_config_from_hf")
    t = "transformer"
    entries: dict[str, tuple[Piece, ...]] = {"wte.weight": (Piece(f"{t}.wte.weight", vocab),),
                                             "wpe.weight": (Piece(f"{t}.wpe.weight"),)}
    optional = []
    for i in range(cfg.num_layers):
        ours, theirs = f"blocks.{i}", f"{t}.h.{i}"
        for norm in ("ln_1", "ln_2"):
            for kind in ("weight", "bias"):
                entries[f"{ours}.{norm}.{kind}"] = (Piece(f"{theirs}.{norm}.{kind}"),)
        for our_layer, their_layer in (("attn.qkv", "attn.c_attn"), ("attn.proj", "attn.c_proj"),
                                       ("mlp.fc", "mlp.c_fc"), ("mlp.proj", "mlp.c_proj")):
            entries[f"{ours}.{our_layer}.weight"] = (Piece(f"{theirs}.{their_layer}.weight", transposed=True),)
            entries[f"{ours}.{our_layer}.bias"] = (Piece(f"{theirs}.{their_layer}.bias"),)
        optional += [f"{theirs}.attn.bias", f"{theirs}.attn.masked_bias"]  # causal-mask buffers of older files
    for kind in ("weight", "bias"):
        entries[f"ln_f.{kind}"] = (Piece(f"{t}.ln_f.{kind}"),)
    return _with_output(entries, cfg, HFFamily.GPT2, vocab, padded={"wte.weight"}, optional=optional,
                        prefix=f"{t}.")
