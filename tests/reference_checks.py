"""Assertions the backend tests share: what a backend streamed after one step against the plain HF
model after the same step, and the two-rank check of the FSDP2 backends (fsdp, torchtitan)."""

import torch


def checkpoint_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A transformers model's parameters under the checkpoint's names (a mixture-of-experts layer's fused
    experts per expert: ``families.base.MoEFamily.checkpoint_views``)."""
    from rlplacement.families import family_for

    family = family_for(model.config)
    return {k: v for n, p in model.named_parameters() for k, v in family.checkpoint_views(n, p)}


def model_parameter(name: str, like: torch.Tensor, streamed: dict[str, torch.Tensor], family) -> torch.Tensor:
    """The full parameter ``name`` (shaped as ``like``) rebuilt from streamed checkpoint-named tensors."""
    out = torch.empty(like.shape, dtype=like.dtype)
    for key, view in family.checkpoint_views(name, out):
        view.copy_(streamed[key])
    return out


def assert_streamed_match_reference(streamed_path, ref: torch.nn.Module, atol: float = 2e-6, rtol: float = 1e-5):
    """Every HF parameter was streamed, under its checkpoint name, and is close to the reference's."""
    streamed = torch.load(streamed_path)
    expected = checkpoint_tensors(ref)
    assert set(streamed) == set(expected)
    for name, tensor in streamed.items():
        torch.testing.assert_close(tensor, expected[name].detach(), atol=atol, rtol=rtol, msg=name)


def step_and_share_stream(backend, batch, streamed_path, rank: int):
    """One rank's part of a multi-rank backend check: log-probs, one step, then the streamed tensors,
    which only rank 0 yields and saves, loaded back on every rank. Returns (logp, metrics, streamed)."""
    import torch.distributed as dist

    logp = backend.log_probs(batch)
    metrics = backend.train_step(batch)
    streamed = dict(backend.iter_hf_tensors())
    assert (len(streamed) > 0) == (rank == 0), "only rank 0 yields"
    if rank == 0:
        torch.save(streamed, streamed_path)
    dist.barrier()
    return logp, metrics, torch.load(streamed_path)


def _two_rank_step(rank, world, backend_name, hf, optim, vocab, seed, streamed_path, options):
    """One rank of :func:`check_two_ranks_match_hf_reference` (module level: ``launch.spawn`` pickles it)."""
    from rlplacement.backends import make_backend
    from rlplacement.backends.hf_reference import random_batch
    from rlplacement.config import BackendConfig

    backend = make_backend(BackendConfig(name=backend_name, hf_checkpoint=hf), optim, **options)
    batch = random_batch(vocab, seed=seed + rank)  # each rank its own data-parallel share
    logp, metrics, streamed = step_and_share_stream(backend, batch, streamed_path, rank)
    if backend_name == "torchtitan":  # its own parameter names, q/k permuted for its interleaved RoPE
        from rlplacement.families import torchtitan_mapping as names

        def held(name):
            return names.hf_to_torchtitan_tensor(name, streamed[names.torchtitan_to_hf_name(name)], backend.hf_config)
    else:
        def held(name):
            return model_parameter(name, params[name], streamed, backend.family)
    params = dict(backend.model.named_parameters())
    mismatched = [n for n, p in params.items() if not torch.equal(p.to_local(), held(n).chunk(world, 0)[rank])]
    return {"logp": logp, "metrics": metrics, "mismatched": mismatched}


def check_two_ranks_match_hf_reference(backend_name: str, hf, tmp_path, optim, *, vocab: int, seed: int,
                                       **options) -> None:
    """The check FSDP2 backends share (fsdp, torchtitan): two gloo ranks each take one step on their own
    batch; their log-probs equal the HF model's, each rank's shards equal the slice of what rank 0
    streamed, the grad norm equals the HF reference step's over both batches, and what was streamed
    equals the reference's weights after that step. ``options`` go to ``make_backend``."""
    import pytest

    from rlplacement.backends import launch
    from rlplacement.backends.hf_reference import hf_log_probs, hf_reference_step, load_hf, random_batch

    streamed_path = str(tmp_path / "streamed.pt")
    results = launch.spawn(_two_rank_step, 2, backend_name, str(hf), optim, vocab, seed, streamed_path, options,
                           timeout_s=300)
    ref = load_hf(hf)
    batches = [random_batch(vocab, seed=seed + r) for r in range(2)]
    for r, res in enumerate(results):
        assert (res["logp"] - hf_log_probs(ref, batches[r].input_ids)).abs().max().item() <= 1e-5
        assert res["mismatched"] == [], f"streamed tensors differ from the shards the {backend_name} backend holds"
    ref_metrics = hf_reference_step(ref, batches, optim)
    assert results[0]["metrics"]["grad_norm"] == pytest.approx(ref_metrics["grad_norm"], rel=1e-4)
    assert_streamed_match_reference(streamed_path, ref)


def peft_reference(hf, lora) -> torch.nn.Module:
    """The HF model of ``hf`` with peft's adapters of ``lora`` at the backends' initial values (``A`` by
    ``lora.initial_a`` of its name, ``B`` zero): what a LoRA backend's model is before its first step."""
    from rlplacement.backends.hf_reference import load_hf
    from rlplacement.backends.lora import initial_a, inject

    ref = load_hf(hf)
    inject(ref, lora)
    with torch.no_grad():
        for name, param in ref.named_parameters():
            if ".lora_A." in name:
                param.copy_(initial_a(name, tuple(param.shape)))
            elif ".lora_B." in name:
                param.zero_()
    return ref


def write_adapter_folder(out, model_dir, rank: int, alpha: float, modules, seed: int = 0) -> dict:
    """A PEFT adapter folder for the model of ``model_dir`` (rank-``rank`` adapters on ``modules``, random ``A``
    and ``B``: the adapters change the model's output), as peft saves one; returns its tensors by name."""
    import json
    from pathlib import Path

    from safetensors.torch import save_file

    from rlplacement.lora_format import adapter_shapes

    shapes = adapter_shapes(json.loads((Path(model_dir) / "config.json").read_text()), rank, modules)
    g = torch.Generator().manual_seed(seed)
    tensors = {name: torch.randn(shape, generator=g) * 0.05 for name, shape in shapes.items()}
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": alpha,
                                                         "target_modules": list(modules)}))
    return tensors
