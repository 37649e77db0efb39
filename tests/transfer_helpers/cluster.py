"""The module-wide setup the real-vLLM transfer tests share: a Ray cluster of our own, a trainer
actor holding a real HF model, and engines of the same folder (engine start-up dominates, so each
test module starts this once)."""

import os

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def start_trainer_and_engines(model_dir: str, num_engines: int = 2):
    """Return ``(trainer, engines)`` on a fresh local Ray (never a neighbour's via RAY_ADDRESS)."""
    import ray

    from rlplacement.engines.ray_engines import create_engine_actor
    from tests.transfer_helpers.trainer_actor import StandInHFTrainer

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": REPO, "RAY_AUTH_MODE": "disabled"}})
    trainer = ray.remote(StandInHFTrainer).options(num_cpus=0).remote(model_dir)
    return trainer, [create_engine_actor(i, model_dir) for i in range(num_engines)]


def outputs(engine, prompts, max_tokens: int):
    """An engine's completions without their timestamps: what must stay equal across updates."""
    import ray

    return [{k: v.tolist() if hasattr(v, "tolist") else v for k, v in r.items()
             if k not in ("finished_at", "first_token_at")}
            for r in ray.get(engine.generate.remote(prompts, max_tokens=max_tokens), timeout=300)]
