"""Megatron backend at TP=1 in this process (gloo world of 1): logits vs HF, one step vs the HF reference."""

import dataclasses

import pytest
import torch
import torch.distributed as dist

from rlplacement.config import BackendConfig, OptimConfig
from rlplacement.errors import ConfigError
from rlplacement.backends import launch, make_backend
from rlplacement.families import megatron_mapping as mapping
from rlplacement.backends.hf_reference import hf_log_probs, hf_reference_step, load_hf, random_batch
from rlplacement.models.tiny import TinySpec, make_tiny_model

SPECS = {
    "qwen3-untied-gqa": TinySpec(family="qwen3", num_attention_heads=4, num_key_value_heads=2),
    "qwen2-tied": TinySpec(family="qwen2", hidden_size=64, num_attention_heads=2, num_key_value_heads=1,
                           tie_word_embeddings=True),
    "llama-gqa": TinySpec(family="llama", num_attention_heads=4, num_key_value_heads=2),
}
SGD = OptimConfig(name="sgd", lr=0.5, max_grad_norm=None)


@pytest.fixture
def single_rank():
    launch.init_single_process("gloo")
    yield
    dist.destroy_process_group()


def _cfg(hf_dir, **kw):
    return BackendConfig(name="megatron", hf_checkpoint=str(hf_dir), load=kw.get("load"),
                         tensor_model_parallel_size=1, pipeline_model_parallel_size=1)


@pytest.mark.parametrize("label", list(SPECS))
def test_log_probs_match_hf_and_one_step_matches_reference(tmp_path, single_rank, label):
    hf_dir = make_tiny_model(tmp_path / "hf", SPECS[label])
    backend = make_backend(_cfg(hf_dir), SGD)
    try:
        batch = random_batch(SPECS[label].vocab_size, seed=1)
        ref = load_hf(hf_dir)
        diff = (backend.log_probs(batch) - hf_log_probs(ref, batch.input_ids)).abs().max().item()
        assert diff <= 1e-5, f"{label}: megatron vs HF log-prob max abs diff {diff}"

        metrics = backend.train_step(batch)
        ref_metrics = hf_reference_step(ref, [batch], SGD)
        assert metrics["loss"] == pytest.approx(ref_metrics["loss"], abs=1e-5)
        assert metrics["grad_norm"] == pytest.approx(ref_metrics["grad_norm"], rel=1e-4)
        streamed = dict(backend.iter_hf_tensors())
        expected = dict(ref.named_parameters())
        if SPECS[label].tie_word_embeddings:
            expected.pop("lm_head.weight", None)
        assert set(streamed) == set(expected)
        for name, tensor in streamed.items():
            torch.testing.assert_close(tensor, expected[name].detach(), atol=2e-6, rtol=1e-5, msg=name)
        # what was streamed is bit-for-bit what the backend holds
        for mname, held in backend.local_megatron_parameters():
            rebuilt = mapping.hf_to_megatron(mname, streamed.__getitem__, backend.shape, backend.family)
            assert torch.equal(rebuilt, held), mname
    finally:
        backend.close()


def test_unknown_backend_lists_known_names():
    with pytest.raises(ConfigError, match="--train-backend 'deepspeed' is unknown: use one of fsdp, megatron, torchtitan"):
        make_backend(dataclasses.replace(_cfg("x"), name="deepspeed"))


def test_megatron_without_a_checkpoint_says_which_flag():
    with pytest.raises(ConfigError, match="needs --load .* or --hf-checkpoint"):
        make_backend(BackendConfig(name="megatron"))


def test_cpu_shims_are_undone_after_close(tmp_path, single_rank):
    import torch

    real = torch.cuda.current_device
    backend = make_backend(_cfg(make_tiny_model(tmp_path / "hf", SPECS["llama-gqa"])), SGD)
    assert torch.cuda.current_device is not real  # megatron needs them while it works
    backend.close()
    assert torch.cuda.current_device is real


def test_auto_spec_says_once_when_a_gpu_host_falls_back_to_local(monkeypatch):
    """Stands in for a GPU host with a broken TransformerEngine (no GPU here): the fallback is said,
    once, with TE's import error."""
    import warnings

    from rlplacement.backends.megatron import model_config as megatron_model

    monkeypatch.setattr(megatron_model, "te_import_error", lambda: "ImportError: libcudnn.so.9 missing")
    monkeypatch.setattr(megatron_model, "_WARNED", set())
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert megatron_model.resolve_spec("auto") == "local"
        assert megatron_model.resolve_spec("auto") == "local"
    messages = [str(w.message) for w in seen if issubclass(w.category, RuntimeWarning)]
    assert len(messages) == 1 and "libcudnn.so.9 missing" in messages[0]
    with pytest.raises(RuntimeError, match="libcudnn.so.9 missing"):
        megatron_model.resolve_spec("te")


@pytest.mark.parametrize("label", ["qwen3-untied-gqa", "qwen2-tied"])
def test_one_rank_updates_from_its_parameters_in_place_as_hf_tensors(tmp_path, single_rank, label):
    """TP = PP = DP = 1: an update streams views of the parameters (the colocated direct path reads them
    in place): after a step they are, reshaped to the HF shapes they name, bit for bit the exported
    stream, and no view owns memory of its own."""
    from rlplacement.transfer.base import hf_shaped

    hf_dir = make_tiny_model(tmp_path / "hf", SPECS[label])
    backend = make_backend(_cfg(hf_dir), SGD)
    try:
        backend.train_step(random_batch(SPECS[label].vocab_size, seed=1))
        assert backend.yields_resident_tensors
        shapes = backend.update_hf_shapes
        grouped = SPECS[label].num_key_value_heads > 1
        assert bool(shapes) == grouped and all(n.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight",
                                                             "q_proj.bias", "k_proj.bias", "v_proj.bias"))
                                                for n in shapes)
        storages = {p.untyped_storage().data_ptr() for _, p in backend.local_megatron_parameters()}
        views = list(backend.iter_update_tensors())
        assert backend.last_stream_collectives == 0
        assert all(v.untyped_storage().data_ptr() in storages for _, v in views)
        assert [a for a, b in zip(views, backend.iter_update_tensors()) if a[1] is not b[1]] == []  # same objects
        exported = list(backend.iter_hf_tensors())
        reshaped = list(hf_shaped(views, shapes))
        assert [n for n, _ in reshaped] == [n for n, _ in exported]
        assert [n for (n, a), (_, b) in zip(reshaped, exported) if not torch.equal(a, b)] == []
    finally:
        backend.close()


@pytest.mark.parametrize("with_entropy", [False, True])
def test_log_probs_go_by_chunks_of_fp32_logits_and_equal_one_piece(tmp_path, single_rank, with_entropy):
    """--log-probs-chunk-size: the fp32 logits, their masking and megatron's vocab-parallel cross-entropy
    exist one chunk of positions at a time (forward and the recomputing backward), and log-probs,
    entropies and their gradients equal the whole-piece ones."""
    from tests.test_backend_base import _Fp32VocabAllocations

    hf_dir = make_tiny_model(tmp_path / "hf", SPECS["qwen3-untied-gqa"])
    backend = make_backend(_cfg(hf_dir), SGD)
    try:
        padded, chunk = backend.shape.padded_vocab_size, 5
        torch.manual_seed(0)
        logits = torch.randn(3, 7, padded, dtype=torch.bfloat16, requires_grad=True)
        ids = torch.randint(0, backend.shape.vocab_size, (3, 7))
        results = {}
        for size in (10 ** 6, chunk):
            backend.train_config = dataclasses.replace(backend.train_config, log_probs_chunk_size=size,
                                                       rollout_temperature=0.7)
            with _Fp32VocabAllocations(padded, backend.hf_config.hidden_size) as seen:
                stats = backend._logits_to_stats(logits, ids, with_entropy=with_entropy)
                total = stats.logp.sum() + (stats.entropy.sum() if with_entropy else 0)
                grad, = torch.autograd.grad(total, logits)
            results[size] = (stats, grad, max(seen.rows))
        (whole, g_whole, rows_whole), (chunked, g_chunked, rows_chunked) = results.values()
        assert rows_whole == 3 * 7 and rows_chunked <= chunk
        torch.testing.assert_close(chunked.logp, whole.logp, rtol=0, atol=1e-6)
        torch.testing.assert_close(g_chunked, g_whole, rtol=0, atol=1e-6)
        if with_entropy:
            torch.testing.assert_close(chunked.entropy, whole.entropy, rtol=0, atol=1e-6)
        want = torch.log_softmax(logits.float()[..., :backend.shape.vocab_size] / 0.7, -1)
        torch.testing.assert_close(chunked.logp[:, 1:], want[:, :-1].gather(-1, ids[:, 1:, None])[..., 0],
                                   rtol=1e-5, atol=1e-5)
    finally:
        backend.close()
