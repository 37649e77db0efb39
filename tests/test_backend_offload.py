"""--offload-train's round trip on real FSDP2 shards (2 gloo ranks, AdamW): the storages are freed while
offloaded, and training after the reload is bit-exact with training that never offloaded.

On CPU the job skips the hand-off (there is no GPU memory to free); this exercises the same code
the GPU path runs, with host buffers that are not pinned."""

import pytest
import torch

from rlplacement.config import BackendConfig, OptimConfig
from rlplacement.backends import launch
from rlplacement.backends.hf_reference import random_batch
from rlplacement.backends.offload import local_tensor
from rlplacement.models.tiny import TinySpec, make_tiny_model
from rlplacement.train_io import Batch

SPEC = TinySpec(family="qwen3", num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
ADAMW = OptimConfig(name="adamw", lr=1e-2)


def _state(backend) -> dict[str, torch.Tensor]:
    out = {f"param/{n}": local_tensor(p).clone() for n, p in backend.model.named_parameters()}
    names = {id(p): n for n, p in backend.model.named_parameters()}
    for p, st in backend.optimizer.state.items():
        for k, v in st.items():
            out[f"optim/{names[id(p)]}/{k}"] = local_tensor(v).clone()
    return out


def _worker(rank, world, hf):
    from rlplacement.backends import make_backend

    cfg = BackendConfig(name="fsdp", hf_checkpoint=hf)
    batches = [random_batch(SPEC.vocab_size, seed=10 * step + rank) for step in range(3)]
    offloaded, resident = make_backend(cfg, ADAMW), make_backend(cfg, ADAMW)
    reserved = offloaded.reserve_host_memory()["bytes"]  # before any step: AdamW has no state yet
    freed, moved, grew = [], [], []
    for batch in batches:
        resident.train_step(batch)
        offloaded.train_step(batch)
        report = offloaded.offload_to_host()
        moved.append(report["bytes"])
        grew.append(report["grew"])
        freed.append(all(local_tensor(t).untyped_storage().nbytes() == 0 for t in offloaded._resident_tensors()))
        try:
            offloaded.offload_to_host()
            twice = None
        except RuntimeError as exc:
            twice = str(exc)
        refused = _weight_reads_refused(rank, world, offloaded)
        offloaded.reload_from_host()
    a, b = _state(offloaded), _state(resident)
    differing = sorted(k for k in b if not torch.equal(a[k], b[k]))
    return {"freed": freed, "moved": moved, "grew": grew, "reserved": reserved, "differing": differing, "keys": len(b), "twice": twice, "refused": refused}


def _weight_reads_refused(rank, world, backend) -> list[str]:
    """What the trainer actor answers to each weight read while its state is on the host."""
    from tests.transfer_helpers.trainer_refusals import trainer_rank_answers

    batch = Batch(torch.tensor([[1, 2, 3]]), torch.tensor([[0.0, 1.0, 1.0]]), torch.tensor([1.0]))
    return trainer_rank_answers(backend, rank, world, [
        lambda w: w.hf_checksums(), lambda w: w.gather_for_update(), lambda w: list(w.hf_named_tensors()),
        lambda w: w.log_probs(batch), lambda w: w.train_step(batch),
        lambda w: w.save_hf_folder("/nonexistent", "/nonexistent")])


@pytest.mark.slow
def test_offload_round_trip_frees_storages_and_training_stays_bit_exact(tmp_path):
    hf = make_tiny_model(tmp_path / "hf", SPEC)
    for res in launch.spawn(_worker, 2, str(hf), timeout_s=300):
        assert res["freed"] == [True] * 3, "some parameter or optimizer storage kept its bytes while offloaded"
        assert min(res["moved"]) > 0
        # the buffer reserved before the first step held every offload: sized from AdamW's state to come
        assert res["reserved"] == max(res["moved"]) and res["grew"] == [0.0] * 3
        assert res["keys"] > 20 and res["differing"] == []
        assert "already in host memory" in res["twice"]
        assert len(res["refused"]) == 6 and all(
            "in host memory (--offload-train" in r and "RLJob.prepare_update()" in r for r in res["refused"]), res["refused"]


def _lora_worker(rank, world, hf):
    from rlplacement.backends import make_backend
    from rlplacement.config import LORA_MODULES, LoRAConfig

    cfg = BackendConfig(name="fsdp", hf_checkpoint=hf, lora=LoRAConfig(rank=4, target_modules=LORA_MODULES))
    offloaded, resident = make_backend(cfg, ADAMW), make_backend(cfg, ADAMW)
    base = sum(local_tensor(p).untyped_storage().nbytes() for p in offloaded.model.parameters() if not p.requires_grad)
    reports = []
    for step in range(3):
        batch = random_batch(SPEC.vocab_size, seed=10 * step + rank)
        resident.train_step(batch)
        offloaded.train_step(batch)
        reports.append(offloaded.offload_to_host())
        freed = all(local_tensor(t).untyped_storage().nbytes() == 0 for t in offloaded._resident_tensors())
        offloaded.reload_from_host()
    a, b = _state(offloaded), _state(resident)
    return {"base": base, "moved": [r["bytes"] for r in reports], "kept": [r["kept_bytes"] for r in reports],
            "freed": freed, "differing": sorted(k for k in b if not torch.equal(a[k], b[k])), "keys": len(b)}


@pytest.mark.slow
def test_lora_hand_off_copies_the_frozen_base_to_host_once(tmp_path):
    """Under LoRA the base is frozen: the first offload copies it to host with the adapters and their AdamW
    moments; later ones free it without a copy (its host bytes are still right) and move only the adapters'
    state. Training after each reload stays bit-exact with a run that never offloaded."""
    hf = make_tiny_model(tmp_path / "hf", SPEC)
    for res in launch.spawn(_lora_worker, 2, str(hf), timeout_s=300):
        assert res["base"] > 0 and res["freed"]
        assert res["kept"] == [0.0, res["base"], res["base"]]
        assert res["moved"][1] == res["moved"][2] == res["moved"][0] - res["base"]
        assert 0 < res["moved"][1] < res["base"] / 4  # the adapters and their moments: a fraction of the base
        assert res["keys"] > 20 and res["differing"] == [], res["differing"]


def test_a_copy_failing_half_way_frees_nothing_and_the_next_offload_works(monkeypatch):
    from rlplacement.backends import offload

    tensors = [torch.arange(1000, dtype=torch.float32) + i for i in range(3)]
    want = [t.clone() for t in tensors]
    real, calls = offload._bytes_of, []

    def failing_second_copy(storage):
        calls.append(storage)
        if len(calls) == 2:
            raise MemoryError("injected: host copy failed")
        return real(storage)

    host = offload.HostOffload()
    monkeypatch.setattr(offload, "_bytes_of", failing_second_copy)
    with pytest.raises(MemoryError, match="injected"):
        host.offload(tensors)
    assert not host.offloaded and all(t.untyped_storage().nbytes() == 4000 for t in tensors)
    monkeypatch.setattr(offload, "_bytes_of", real)
    report = host.offload(tensors)
    assert report["bytes"] == 12000 and all(t.untyped_storage().nbytes() == 0 for t in tensors)
    host.reload()
    assert all(torch.equal(t, w) for t, w in zip(tensors, want))


def test_fused_adam_state_to_come_is_counted_in_its_own_dtypes_cpu_stand_in():
    """megatron's Adam on a GPU is TransformerEngine's FusedAdam (GPU only; a stand-in with its attributes
    here): the pinned buffer reserved at start must hold its moments in their dtypes (and master copies
    with master_weights), or the first hand-off grows it mid-step."""
    from types import SimpleNamespace

    from rlplacement.backends.base import TrainerBackend

    class StandInTEFusedAdam(torch.optim.Optimizer):
        def __init__(self, params, exp_avg_dtype, exp_avg_sq_dtype, master_weights=False):
            super().__init__(params, {})
            self.exp_avg_dtype, self.exp_avg_sq_dtype, self.master_weights = exp_avg_dtype, exp_avg_sq_dtype, master_weights

    # TrainerBackend._state_to_come tells TE's (or apex's) optimizer by ``type(opt).__name__ == "FusedAdam"``
    # (rlplacement/backends/backend_offload.py): the stand-in answers to that name; its __qualname__ still says stand-in
    StandInTEFusedAdam.__name__ = "FusedAdam"

    param = torch.nn.Parameter(torch.zeros(10, dtype=torch.bfloat16))
    backend = SimpleNamespace(device=torch.device("cpu"), _stepped_by=lambda p: True)
    assert TrainerBackend._state_to_come(backend, StandInTEFusedAdam([param], torch.float32, torch.bfloat16)) == 10 * (4 + 2)
    assert TrainerBackend._state_to_come(backend, StandInTEFusedAdam([param], torch.float32, torch.float32, True)) == 10 * 12
    stepped = StandInTEFusedAdam([param], torch.float32, torch.float32)
    stepped.state[param] = {"exp_avg": torch.zeros(10)}
    assert TrainerBackend._state_to_come(backend, stepped) == 0  # state that exists is counted where it lives
