"""Rollout flags (sampling defaults and the engines' settings) and their validation."""

from __future__ import annotations

import argparse

from rlplacement.args.common import flag, get, require_choice, require_positive
from rlplacement.console import VERBOSITY
from rlplacement.config import ENGINE_DTYPES, RolloutConfig, TrainConfig, default_of
from rlplacement.errors import ConfigError
from rlplacement.specs.engine import known_engines

TITLE = "rlplacement: rollout"
FLAGS = (
    flag("--rollout-name", type=str, default=default_of(RolloutConfig, "engine_kind"),
          help="The rollout engine kind (verl's rollout.name): vllm, or one a package registers "
               "(docs/extending.md)."),
    flag("--rollout-temperature", type=float, default=default_of(TrainConfig, "rollout_temperature"),
          help="Sampling temperature; the trainer's logits are divided by it too."),
    flag("--rollout-top-p", type=float, default=default_of(RolloutConfig, "top_p")),
    flag("--rollout-top-k", type=int, default=default_of(RolloutConfig, "top_k"), help="-1: all tokens."),
    flag("--rollout-max-response-len", type=int, default=default_of(RolloutConfig, "max_response_len"),
          help="Most tokens generated per sample."),
    flag("--rollout-stop", type=str, nargs="+", default=None, help="Strings that end a sample."),
    flag("--rollout-stop-token-ids", type=int, nargs="+", default=None,
          help="Token ids that end a sample (besides end-of-sequence)."),
    flag("--n-samples-per-prompt", type=int, default=default_of(RolloutConfig, "n_samples_per_prompt"),
          help="Samples per prompt (a GRPO group), all on one engine (its prefix cache serves them)."),
    flag("--rollout-seed", type=int, default=default_of(RolloutConfig, "seed"),
          help="Base of the per-sample sampling seeds."),
    flag("--vllm-dtype", type=str, default=default_of(RolloutConfig, "dtype"), choices=ENGINE_DTYPES,
          help="Engine dtype; auto: the one the model's config declares."),
    flag("--vllm-max-model-len", "--rollout-max-context-len", type=int,
          default=default_of(RolloutConfig, "max_model_len"),
          help="Engine context length (prompt + response); default: the model's max_position_embeddings."),
    flag("--vllm-enforce-eager", action="store_true", default=default_of(RolloutConfig, "enforce_eager"),
          help="Decode without CUDA graphs (CPU engines always run eager)."),
    flag("--vllm-gpu-memory-utilization", type=float,
          default=default_of(RolloutConfig, "gpu_memory_utilization"),
          help="Fraction of its GPU an engine may use, what an update holds on it (--update-weight-staging) "
               "counted inside: vLLM gets this less that; default: vLLM's 0.9."),
    flag("--verbose", nargs="?", const="info", default=default_of(RolloutConfig, "verbosity"), choices=VERBOSITY,
          help="quiet: no start-up lines; normal (default): a line per start-up stage; info (--verbose alone): "
               "vLLM and Ray at INFO too."),
)


def rollout_from_args(args: argparse.Namespace) -> RolloutConfig:
    require_positive(args, ("rollout_max_response_len", "n_samples_per_prompt", "vllm_max_model_len",
                             "vllm_gpu_memory_utilization", "rollout_top_p"))
    require_choice(args, ("vllm_dtype",))
    top_p, top_k = float(get(args, "rollout_top_p")), int(get(args, "rollout_top_k"))
    if top_p > 1:
        raise ConfigError(f"--rollout-top-p {top_p} is a probability mass: use a value in (0, 1] (1 keeps every token).")
    if top_k == 0 or top_k < -1:
        raise ConfigError(f"--rollout-top-k {top_k}: use -1 (every token) or 1 or more.")
    utilization = get(args, "vllm_gpu_memory_utilization")
    if utilization is not None and utilization > 1:
        raise ConfigError(f"--vllm-gpu-memory-utilization {utilization} is a fraction of the GPU: use a value "
                          f"in (0, 1].")
    response, context = int(get(args, "rollout_max_response_len")), get(args, "vllm_max_model_len")
    if context is not None and response >= context:
        raise ConfigError(f"--rollout-max-response-len {response} leaves no room for a prompt in the engines' "
                          f"context of --vllm-max-model-len {context}: lower --rollout-max-response-len or raise "
                          f"--vllm-max-model-len.")
    engine_kind = str(get(args, "rollout_name"))
    if engine_kind not in known_engines():
        raise ConfigError(f"--rollout-name {engine_kind!r} is unknown: use one of {', '.join(known_engines())} "
                          f"(a package registers more: docs/extending.md).")
    return RolloutConfig(engine_kind=engine_kind, top_p=top_p, top_k=top_k, max_response_len=response,
                         stop=tuple(get(args, "rollout_stop") or ()),
                         stop_token_ids=tuple(int(t) for t in get(args, "rollout_stop_token_ids") or ()),
                         n_samples_per_prompt=int(get(args, "n_samples_per_prompt")),
                         seed=int(get(args, "rollout_seed")), dtype=get(args, "vllm_dtype"),
                         max_model_len=None if context is None else int(context),
                         enforce_eager=bool(get(args, "vllm_enforce_eager")),
                         gpu_memory_utilization=None if utilization is None else float(utilization),
                         verbosity=_verbosity(get(args, "verbose")))


def _verbosity(value) -> str:
    """``--verbose``'s level; a namespace from a parser whose own ``--verbose`` is a switch gives a bool."""
    if isinstance(value, bool) or value is None:
        return "info" if value else "normal"
    if value not in VERBOSITY:
        raise ConfigError(f"--verbose {value!r} is unknown: use one of {', '.join(VERBOSITY)} (--verbose alone: info).")
    return value
