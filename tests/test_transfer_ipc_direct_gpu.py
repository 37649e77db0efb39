"""Mode ``cuda_ipc``'s direct path on a real GPU: the receivers copy straight out of the sender
process's own tensors (one CUDA IPC handle per allocation), bit for bit, and the sender's
``update`` returns only once every receiver committed or dropped the update and unmapped it.
Skipped without a GPU: the trainer's memory cannot be mapped by another process on CPU, where
``resident=True`` falls back to the bucket path (tests/test_transfer_ipc.py).
"""

import os

import pytest
import torch

from tests.transfer_helpers.spawned import run_sender_and_receivers

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                  reason="the direct path maps another process's GPU memory")]

N_RECEIVERS = 2
VERSIONS = [1, 2, 3]


def _weights() -> list:
    """Resident tensors as a trainer holds them: parameters in a few allocations, updated in place."""
    g = torch.Generator(device="cuda").manual_seed(0)
    named = []
    for layer in range(3):
        p = f"model.layers.{layer}."
        named += [(p + "self_attn.q_proj.weight", torch.randn(512, 256, device="cuda", generator=g).bfloat16()),
                  (p + "input_layernorm.weight", torch.randn(256, device="cuda", generator=g)),
                  (p + "mlp.up_proj.weight", torch.randn(256, 1024, device="cuda", generator=g).half().t())]
    named += [("model.embed_tokens.weight", torch.randn(4096, 256, device="cuda", generator=g).bfloat16())]
    return named


def _step(named, version: int) -> None:
    with torch.no_grad():
        for _, t in named:
            t.add_(version)  # in place: the allocations stay, so do the exports


def _connected_sender(endpoint_q, keep_mapped: bool, check_equal: bool):
    """A cuda_ipc sender on GPU 0 joined by the N receivers (its endpoint handed to each on ``endpoint_q``)."""
    from rlplacement.transfer import registry

    sender = registry.sender_class("cuda_ipc")(1 << 20, check_equal=check_equal, timeout_s=60, device="cuda:0")
    endpoint = sender.listen(1 + N_RECEIVERS, host="127.0.0.1")
    for _ in range(N_RECEIVERS):
        endpoint_q.put(endpoint.to_dict())
    sender.connect()
    sender.exports.keep_mapped = keep_mapped  # as keep_mapped_between_updates() sets it, or not
    return sender


def _sender(alloc_conf, endpoint_q, result_q, fault, keep_mapped, check_equal):
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = alloc_conf
    from rlplacement.transfer.base import tensor_checksum
    from rlplacement.transfer.base import UpdateAborted
    from rlplacement.errors import UpdateRefused

    try:
        sender = _connected_sender(endpoint_q, keep_mapped, check_equal)
        named = _weights()
        out = {"paths": [], "failed": {}, "sums": {}, "rounds": {}}
        for v in VERSIONS:
            _step(named, v)
            try:
                report = sender.update(v, named, resident=True)
                if check_equal:
                    assert report.checksums == {n: tensor_checksum(t) for n, t in named}
                out["paths"].append(report.path)
            except (UpdateRefused, UpdateAborted) as exc:
                out["failed"][v] = f"{type(exc).__name__}: {exc}"
            out["rounds"][v] = sender.last_direct_rounds
            out["sums"][v] = {n: tensor_checksum(t) for n, t in named}
        from rlplacement.transfer.cuda_ipc.driver import allocation_of

        out.update(exported=sender.exports.handles_exported, refusal=sender.fallback,
                   allocations=len({allocation_of(t.data_ptr()).buffer_id for _, t in named}))
        result_q.put(("sender", out))
        sender.close()
    except BaseException as exc:  # noqa: BLE001
        result_q.put(("sender", f"{type(exc).__name__}: {exc}"))


def _receiver(rank, endpoint_q, result_q, fault, keep_mapped, check_equal):
    from rlplacement.transfer import registry
    from rlplacement.transfer.base import TransferEndpoint, tensor_checksum

    try:
        receiver = registry.receiver_class("cuda_ipc")("cuda:0")
        receiver.connect(TransferEndpoint.from_dict(endpoint_q.get(timeout=60)), rank)
        served = {}  # this receiver's own copy of the weights: what an engine would serve
        sums, errors = {}, {}
        if fault and fault[0] == "corrupt" and rank == 1:  # this rank reads wrong bytes for one update
            real_map = receiver.direct.map

            def wrong_map():
                views = real_map()
                if receiver._pending == fault[1]:
                    views[0] = (views[0][0], torch.zeros_like(views[0][1]))
                return views

            receiver.direct.map = wrong_map
        for v in VERSIONS:
            receiver.begin(v)
            try:
                receiver.receive()
            except Exception as exc:  # noqa: BLE001 - an aborted update: recorded, the next one goes on
                errors[v] = f"{type(exc).__name__}: {exc}"
            else:
                if fault == ("drop", v) and rank == 1:
                    receiver.abort()  # e.g. the engine's validation refused it: keeps the previous version
                else:
                    receiver.commit(lambda staged: served.update({n: t.clone() for n, t in staged}))
            sums[v] = {n: tensor_checksum(t) for n, t in served.items()}
        opened = receiver.direct.handles_opened
        result_q.put((f"receiver {rank}", {"sums": sums, "errors": errors, "version": receiver.version,
                                           "hf_shapes": dict(receiver.staged_hf_shapes),
                                           "path": receiver.last_path, "opened": opened, "unmapped": receiver.unmap(),
                                           "verified": receiver.verified_checksums}))
        receiver.close()
    except BaseException as exc:  # noqa: BLE001
        result_q.put((f"receiver {rank}", f"{type(exc).__name__}: {exc}"))


def _run(alloc_conf: str, fault: tuple[str, int] | None, keep_mapped: bool = False, check_equal: bool = True) -> dict:
    return run_sender_and_receivers(_sender, _receiver, N_RECEIVERS, sender_args=(alloc_conf,),
                                    extra=(fault, keep_mapped, check_equal))


@pytest.mark.parametrize("keep_mapped", [False, True])
def test_direct_updates_are_bit_exact_with_one_handle_per_allocation(keep_mapped):
    results = _run("", None, keep_mapped)
    sender = results["sender"]
    assert sender["paths"] == ["direct"] * len(VERSIONS) and sender["refusal"] == ""
    for rank in range(1, 1 + N_RECEIVERS):
        got = results[f"receiver {rank}"]
        assert got["version"] == VERSIONS[-1] and got["path"] == "direct" and not got["errors"]
        assert got["verified"] == sender["sums"][VERSIONS[-1]]  # hashed on the receiver, kept for the engine
        for v in VERSIONS:
            assert got["sums"][v] == sender["sums"][v]
        if keep_mapped:  # mapped once, kept between updates until the receiver is told to let go
            assert got["opened"] == got["unmapped"] == sender["allocations"]
        else:  # every update maps each allocation again (all are unmapped before the sender returns) ...
            assert got["opened"] == sender["allocations"] * len(VERSIONS) and got["unmapped"] == 0
    # ... while the sender exports each allocation once, not once per tensor or per update
    assert sender["exported"] == sender["allocations"] < 10  # 10 tensors


def test_kept_mappings_commit_in_one_round_bit_exact():
    """Unchecked updates of an unchanged manifest that every receiver kept mapped: one frame, one
    acknowledgement (the first update maps, in two rounds), every version served bit for bit."""
    results = _run("", None, keep_mapped=True, check_equal=False)
    sender = results["sender"]
    assert sender["paths"] == ["direct"] * len(VERSIONS) and not sender["failed"]
    assert sender["rounds"] == {1: 2, 2: 1, 3: 1}
    for rank in range(1, 1 + N_RECEIVERS):
        got = results[f"receiver {rank}"]
        assert got["version"] == VERSIONS[-1] and not got["errors"]
        assert all(got["sums"][v] == sender["sums"][v] for v in VERSIONS)
        assert got["opened"] == sender["allocations"]  # mapped by the first update only


def test_a_receiver_that_drops_a_one_round_update_keeps_its_version_and_the_next_maps_again():
    results = _run("", ("drop", 2), keep_mapped=True, check_equal=False)
    sender = results["sender"]
    assert sender["rounds"] == {1: 2, 2: 1, 3: 2}  # after a refusal nobody is assumed to hold the mappings
    assert "engine worker rank(s) 1 did not commit update 2" in sender["failed"][2]
    dropped, other = results["receiver 1"], results["receiver 2"]
    assert dropped["sums"][2] == sender["sums"][1] and other["sums"][2] == sender["sums"][2]
    assert dropped["sums"][3] == other["sums"][3] == sender["sums"][3]


def test_a_receiver_that_drops_a_direct_update_keeps_its_version_and_the_group_stays_in_step():
    results = _run("", ("drop", 2))
    sender = results["sender"]
    assert "engine worker rank(s) 1 did not commit update 2" in sender["failed"][2]
    assert sender["paths"] == ["direct", "direct"]  # versions 1 and 3
    dropped, other = results["receiver 1"], results["receiver 2"]
    assert dropped["sums"][2] == sender["sums"][1]  # still serves version 1 whole
    assert other["sums"][2] == sender["sums"][2]
    assert dropped["sums"][3] == other["sums"][3] == sender["sums"][3]


def test_a_receiver_reading_other_bytes_aborts_the_direct_update_everywhere():
    results = _run("", ("corrupt", 2), keep_mapped=True)
    sender = results["sender"]
    assert sender["failed"][2].startswith("UpdateAborted") and "rank(s) 1 could not map or verify" in sender["failed"][2]
    wrong, other = results["receiver 1"], results["receiver 2"]
    assert wrong["errors"][2].startswith("WeightMismatchError") and "model.layers.0.self_attn.q_proj" in wrong["errors"][2]
    assert other["errors"][2].startswith("UpdateAborted")
    for got in (wrong, other):  # nobody serves version 2; version 3 goes through, checked
        assert got["sums"][2] == sender["sums"][1] and got["sums"][3] == sender["sums"][3]
        assert got["verified"] == sender["sums"][3]  # the receiver's own hashes, kept for the engine


def test_expandable_segments_fall_back_to_buckets_and_say_why():
    results = _run("expandable_segments:True", None)
    sender = results["sender"]
    assert sender["paths"] == ["buckets"] * len(VERSIONS)
    assert "legacy CUDA IPC handle cannot export" in sender["refusal"]
    for rank in range(1, 1 + N_RECEIVERS):
        got = results[f"receiver {rank}"]
        assert got["path"] == "buckets" and got["sums"][VERSIONS[-1]] == sender["sums"][VERSIONS[-1]]


def test_reloaded_trainer_state_lies_in_one_allocation():
    from rlplacement.backends.offload import HostOffload
    from rlplacement.transfer.cuda_ipc.driver import allocation_of

    tensors = [torch.randn(n, device="cuda") for n in (300_000, 2_000_000, 5_000_000, 700_000, 64)]
    before = [t.cpu() for t in tensors]  # nothing else on the GPU: every segment is free once offloaded
    offload = HostOffload()
    offload.offload(tensors)
    offload.reload()
    assert all(torch.equal(a.cpu(), b) for a, b in zip(tensors, before))
    large = [t for t in tensors if t.numel() * 4 > 1 << 20]
    assert len({allocation_of(t.data_ptr()).buffer_id for t in large}) == 1


def test_the_driver_is_asked_again_only_after_the_allocator_freed_or_made_a_segment(monkeypatch):
    """Exports are re-checked with the driver only when torch's allocator changed its segments; a
    tensor re-made in a new allocation (even at the same address) is then exported afresh."""
    from rlplacement.transfer.cuda_ipc import driver as cuda_driver
    from rlplacement.transfer.cuda_ipc.direct import AllocationExports

    asked = []
    real = cuda_driver.allocation_of
    monkeypatch.setattr(cuda_driver, "allocation_of", lambda ptr: asked.append(ptr) or real(ptr))
    named = _weights()
    torch.cuda.empty_cache()  # no cached block is left to carve the next one from: it gets a segment of its own
    named.append(("lm_head.weight", torch.empty(64 << 20, dtype=torch.bfloat16, device="cuda").normal_()))
    torch.cuda.synchronize()
    exports = AllocationExports(torch.device("cuda", 0))
    first, _ = exports.manifest(named)
    exported, asked[:] = exports.handles_exported, []
    assert exports.manifest(named)[0] is first and asked == []  # nothing changed: no driver call at all
    name, old = named[-1]
    size, dtype = old.shape, old.dtype
    freed_buffer = cuda_driver.allocation_of(old.data_ptr()).buffer_id
    named[-1] = (name, None)
    del old
    torch.cuda.empty_cache()  # its segment is freed
    named[-1] = (name, torch.zeros(size, dtype=dtype, device="cuda"))
    assert cuda_driver.allocation_of(named[-1][1].data_ptr()).buffer_id != freed_buffer  # a new allocation
    asked[:] = []
    again, _ = exports.manifest(named)
    assert asked and exports.handles_exported == exported + 1 and again != first


def _backend_sender(hf_dir, endpoint_q, result_q, fault, keep_mapped, check_equal):
    """A mixed-precision FSDP trainer (fp32 master weights, bf16 served): each version is one optimizer
    step, streamed as the backend's persistent bf16 copies through the direct path."""
    from rlplacement.backends import make_backend
    from rlplacement.backends.hf_reference import random_batch
    from rlplacement.config import BackendConfig, OptimConfig, TrainConfig
    from rlplacement.transfer.base import tensor_checksum

    try:
        backend = make_backend(BackendConfig(name="fsdp", hf_checkpoint=hf_dir), OptimConfig(lr=1e-2),
                               TrainConfig(bf16=True))
        sender = _connected_sender(endpoint_q, keep_mapped, check_equal)
        out = {"paths": [], "failed": {}, "sums": {}, "rounds": {}, "same_objects": [], "cast_of_master": []}
        previous = None
        for v in VERSIONS:
            backend.train_step(random_batch(backend.hf_config.vocab_size, seed=v))
            named = list(backend.iter_hf_tensors())
            if previous is not None:
                out["same_objects"].append(all(a[1] is b[1] for a, b in zip(previous, named)))
            previous = named
            masters = {n: p.to_local().detach() for n, p in backend.model.named_parameters()}
            out["cast_of_master"].append(all(t.dtype == torch.bfloat16 and masters[n].dtype == torch.float32
                                             and torch.equal(t, masters[n].bfloat16()) for n, t in named))
            report = sender.update(v, named, resident=backend.yields_resident_tensors)
            out["paths"].append(report.path)
            out["rounds"][v] = sender.last_direct_rounds
            out["sums"][v] = {n: tensor_checksum(t) for n, t in named}
        out["refusal"] = sender.fallback
        result_q.put(("sender", out))
        sender.close()
    except BaseException as exc:  # noqa: BLE001
        result_q.put(("sender", f"{type(exc).__name__}: {exc}"))


def test_mixed_precision_trainer_serves_its_bf16_copies_through_the_direct_path(tmp_path):
    """fp32 master weights, bf16 served: the stream is one allocation of bf16 copies refreshed by a cast
    each update (the same tensor objects every time), read in place by the receivers, bit for bit."""
    from rlplacement.models.tiny import TinySpec, make_tiny_model

    hf = make_tiny_model(tmp_path / "hf", TinySpec(family="qwen3", num_attention_heads=4, num_key_value_heads=2))
    results = run_sender_and_receivers(_backend_sender, _receiver, N_RECEIVERS, sender_args=(str(hf),),
                                       extra=(None, True, False))
    sender = results["sender"]
    assert sender["paths"] == ["direct"] * len(VERSIONS) and sender["refusal"] == ""
    assert sender["same_objects"] == [True, True] and sender["cast_of_master"] == [True] * len(VERSIONS)
    assert sender["rounds"] == {1: 2, 2: 1, 3: 1}  # the served copies stay put: mapped once, one round after
    for rank in range(1, 1 + N_RECEIVERS):
        got = results[f"receiver {rank}"]
        assert not got["errors"] and all(got["sums"][v] == sender["sums"][v] for v in VERSIONS)


def _megatron_sender(hf_dir, endpoint_q, result_q, fault, keep_mapped, check_equal):
    """A Megatron trainer of one rank under --bf16 (Float16Module, fp32 main parameters in the optimizer):
    each version one optimizer step, streamed as views of its bf16 parameters, q/k/v as row groups."""
    from rlplacement.backends import make_backend
    from rlplacement.backends.hf_reference import random_batch
    from rlplacement.config import BackendConfig, OptimConfig, TrainConfig
    from rlplacement.transfer.base import hf_shaped, tensor_checksum

    try:
        backend = make_backend(BackendConfig(name="megatron", hf_checkpoint=hf_dir), OptimConfig(lr=1e-2),
                               TrainConfig(bf16=True))
        sender = _connected_sender(endpoint_q, keep_mapped, check_equal)
        out = {"paths": [], "failed": {}, "sums": {}, "rounds": {}, "exported_equal": []}
        for v in VERSIONS:
            backend.train_step(random_batch(backend.hf_config.vocab_size, seed=v))
            named = list(backend.iter_update_tensors())
            shapes = backend.update_hf_shapes
            out["exported_equal"].append(all(torch.equal(a, b) for (_, a), (_, b) in
                                             zip(hf_shaped(named, shapes), backend.iter_hf_tensors())))
            report = sender.update(v, named, resident=backend.yields_resident_tensors, hf_shapes=shapes)
            out["paths"].append(report.path)
            out["sums"][v] = {n: tensor_checksum(t) for n, t in named}
        out["refusal"], out["hf_shapes"] = sender.fallback, shapes
        result_q.put(("sender", out))
        sender.close()
        backend.close()
    except BaseException as exc:  # noqa: BLE001
        result_q.put(("sender", f"{type(exc).__name__}: {exc}"))


def test_megatron_trainer_serves_its_fused_parameters_through_the_direct_path(tmp_path):
    """q, k and v are row groups of Megatron's fused QKV: mapped in place as such, named with their HF
    shapes on every receiver, bit for bit (C order is the HF tensor's)."""
    pytest.importorskip("megatron.core")
    from rlplacement.models.tiny import TinySpec, make_tiny_model

    hf = make_tiny_model(tmp_path / "hf", TinySpec(family="qwen3", num_attention_heads=4, num_key_value_heads=2))
    results = run_sender_and_receivers(_megatron_sender, _receiver, N_RECEIVERS, sender_args=(str(hf),),
                                       extra=(None, True, True))
    sender = results["sender"]
    assert sender["paths"] == ["direct"] * len(VERSIONS) and sender["refusal"] == ""
    assert sender["exported_equal"] == [True] * len(VERSIONS) and len(sender["hf_shapes"]) == 3 * 2  # 2 layers
    for rank in range(1, 1 + N_RECEIVERS):
        got = results[f"receiver {rank}"]
        assert not got["errors"] and all(got["sums"][v] == sender["sums"][v] for v in VERSIONS)
        assert {n: tuple(s) for n, s in got["hf_shapes"].items()} == {n: tuple(s) for n, s in sender["hf_shapes"].items()}
