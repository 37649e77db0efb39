"""Tiny Hugging Face models made offline: a config, random weights and a tokenizer trained here.

Nothing is downloaded. The tokenizer is a byte-level BPE trained with ``tokenizers`` on a small
built-in corpus, so vLLM and transformers load the folder like any hub model. ``head_dim`` stays
>= 32 because vLLM's CPU attention rejects smaller heads. The default vocabulary (300) is not a
multiple of 128 so Megatron's vocabulary padding is exercised.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

FAMILIES = ("qwen3", "qwen2", "llama", "qwen3_moe")

_CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "one two three four five six seven eight nine ten",
    "reinforcement learning trains a policy from rewards",
    "the trainer sends weights to the rollout engines after every step",
    "what is two plus three ? the answer is five",
    "what is four plus four ? the answer is eight",
    "count : 1 2 3 4 5 6 7 8 9 10",
    "abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ 0123456789 .,;:!?'\"()[]{}+-*/=<>",
]
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


@dataclasses.dataclass(frozen=True)
class TinySpec:
    family: str = "qwen3"
    vocab_size: int = 300
    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 2
    num_key_value_heads: int = 1
    head_dim: int = 32
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 512
    dtype: str = "float32"
    seed: int = 0
    lm_head_std: float | None = None
    """The output layer's init std (None: HF's ``initializer_range``, 0.02); untied heads only."""
    # qwen3_moe only: experts per sparse layer, top-k, each expert's width, which layers are sparse
    num_experts: int = 4
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 64
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    norm_topk_prob: bool = True
    router_aux_loss_coef: float = 0.0  # above 0: output_router_logits on, the load-balancing loss trained


def build_tokenizer(vocab_size: int):
    """A byte-level BPE tokenizer of exactly ``vocab_size`` entries (padded with reserved tokens)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_CORPUS * 4, trainer)
    have = tok.get_vocab_size()
    if have > vocab_size:
        raise ValueError(f"vocab_size {vocab_size} is below the byte alphabet ({have}); use >= {have}")
    tok.add_tokens([f"<|reserved_{i}|>" for i in range(vocab_size - have)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>",
                                   bos_token=None, unk_token=None)
    fast.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    return fast


def build_config(spec: TinySpec):
    import transformers

    common = dict(vocab_size=spec.vocab_size, hidden_size=spec.hidden_size,
                  intermediate_size=spec.intermediate_size, num_hidden_layers=spec.num_hidden_layers,
                  num_attention_heads=spec.num_attention_heads, num_key_value_heads=spec.num_key_value_heads,
                  max_position_embeddings=spec.max_position_embeddings,
                  tie_word_embeddings=spec.tie_word_embeddings, rms_norm_eps=1e-6)
    if spec.family == "qwen3":
        cfg = transformers.Qwen3Config(head_dim=spec.head_dim, **common)
    elif spec.family == "qwen2":
        if spec.hidden_size != spec.num_attention_heads * spec.head_dim:
            raise ValueError("qwen2 derives head_dim = hidden_size / num_attention_heads")
        cfg = transformers.Qwen2Config(**common)
    elif spec.family == "qwen3_moe":
        cfg = transformers.Qwen3MoeConfig(head_dim=spec.head_dim, num_experts=spec.num_experts,
                                          num_experts_per_tok=spec.num_experts_per_tok,
                                          moe_intermediate_size=spec.moe_intermediate_size,
                                          decoder_sparse_step=spec.decoder_sparse_step,
                                          mlp_only_layers=list(spec.mlp_only_layers),
                                          norm_topk_prob=spec.norm_topk_prob,
                                          output_router_logits=spec.router_aux_loss_coef > 0,
                                          router_aux_loss_coef=spec.router_aux_loss_coef, **common)
    elif spec.family == "llama":
        cfg = transformers.LlamaConfig(head_dim=spec.head_dim, **common)
    else:
        raise ValueError(f"family {spec.family!r} is unknown: use one of {FAMILIES}")
    cfg.dtype = spec.dtype
    return cfg


_MADE_FORMAT = 1  # bump when make_tiny_model writes other bytes for the same spec and versions
CACHE_ENV = "RLPLACEMENT_TINY_MODEL_CACHE"
"""Where made folders are kept (default ``$XDG_CACHE_HOME/rlplacement/tiny-models``, else ``~/.cache``);
``0``: none kept, every call makes its folder."""


def _cache_dir(spec: TinySpec) -> Path | None:
    """The folder a made ``spec`` is kept in, named by the spec and the versions of what makes its bytes
    (a new transformers, torch or tokenizers makes a new folder); None when caching is off."""
    import hashlib
    from importlib.metadata import version

    root = os.environ.get(CACHE_ENV)
    if root == "0":
        return None
    if not root:
        root = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "rlplacement",
                            "tiny-models")
    made_by = {pkg: version(pkg) for pkg in ("transformers", "torch", "tokenizers")}
    key = json.dumps([dataclasses.asdict(spec), made_by, _MADE_FORMAT], sort_keys=True)
    return Path(root) / hashlib.sha256(key.encode()).hexdigest()[:24]


def _copy_files(src: Path, dst: Path) -> None:
    import shutil

    for f in src.iterdir():
        shutil.copyfile(f, dst / f.name)  # copies, never links: a caller may edit its folder


def _keep(out: Path, cached: Path) -> None:
    """``out``'s files kept as ``cached``, published by rename: whole or not at all (a concurrent maker's
    folder, published first, is the one kept)."""
    import shutil
    import tempfile

    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".making-", dir=cached.parent))
    except OSError:
        return  # an unwritable cache: the folder is made, only not kept
    try:
        _copy_files(out, tmp)
        os.rename(tmp, cached)
    except OSError:  # published by another maker meanwhile, or a full disk
        shutil.rmtree(tmp, ignore_errors=True)


def make_tiny_model(out_dir: str | os.PathLike, spec: TinySpec = TinySpec()) -> Path:
    """Write a loadable HF folder (config, safetensors weights, tokenizer) to ``out_dir``.

    Deterministic for a given spec (seeded init), so two calls give identical bytes; a folder once made
    is kept (:data:`CACHE_ENV`) and copied on later calls, which then import neither torch nor
    transformers.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cached = _cache_dir(spec)
    if cached is not None and cached.is_dir():  # published whole (_keep)
        _copy_files(cached, out)
        return out
    _make(out, spec)
    if cached is not None:
        _keep(out, cached)
    return out


def _make(out: Path, spec: TinySpec) -> None:
    import torch
    import transformers

    cfg = build_config(spec)
    torch.manual_seed(spec.seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=getattr(torch, spec.dtype))
    with torch.no_grad():  # HF init leaves norms at 1 and biases at 0; perturb so mappings are tested
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.05)
        if spec.lm_head_std is not None and not spec.tie_word_embeddings:
            model.lm_head.weight.normal_(0.0, spec.lm_head_std)
    from transformers.utils import logging as hf_logging

    bar_was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # a one-shard progress bar says nothing
    try:
        model.save_pretrained(out, safe_serialization=True)
    finally:
        if bar_was_on:
            hf_logging.enable_progress_bar()
    build_tokenizer(spec.vocab_size).save_pretrained(out)
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": 0, "pad_token_id": 0}))
