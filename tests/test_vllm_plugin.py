"""The vLLM entry point registers our backend idempotently, and bad wiring fails with clear errors."""

import pytest

pytest.importorskip("vllm")
pytestmark = pytest.mark.slow  # importing vllm alone takes ~15-40 s on 2 busy cores


def test_register_is_idempotent_and_lazy():
    from importlib.metadata import entry_points

    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    from rlplacement.engines.vllm import vllm_plugin

    assert any(ep.value == "rlplacement.engines.vllm.vllm_plugin:register" for ep in entry_points(group="vllm.general_plugins"))
    assert vllm_plugin.register() and vllm_plugin.register()
    assert "rlplacement" in WeightTransferEngineFactory._registry
    cls = WeightTransferEngineFactory._registry["rlplacement"]()
    assert cls.__name__ == "RlplacementWeightTransferEngine"


def test_init_info_rejects_unknown_fields_and_modes():
    from rlplacement.engines.vllm.vllm_backend import RlplacementInitInfo
    from rlplacement.transfer import registry

    with pytest.raises(TypeError):
        RlplacementInitInfo(mode="broadcast", host="h", port=1, world_size=2, backend="gloo", group_name="g",
                            rank_offset=1, colour="blue")
    with pytest.raises(ValueError, match="unknown: use one of broadcast, broadcast_packed, cuda_ipc"):
        registry.receiver_class("p2p-by-post")


def test_colocate_config_sets_up_the_ipc_sender():
    import argparse

    from rlplacement.args import add_arguments, config_from_args
    from rlplacement.runtime.trainer_transfer import TrainerTransferMixin

    args = add_arguments(argparse.ArgumentParser()).parse_args(
        ["--colocate", "--actor-num-gpus-per-node", "2", "--num-gpus-per-node", "2"])
    trainer = TrainerTransferMixin()
    trainer.transfer_setup_from_config(config_from_args(args).transfer, device="cpu")
    try:
        assert type(trainer.transfer_sender).__name__ == "IpcSender" and trainer.transfer_sender.backend == "gloo"
    finally:
        trainer.transfer_close()


def test_workers_disagreeing_name_the_tensor():
    from rlplacement.engines.vllm.vllm_updates import workers_disagree

    first = {"a": "01", "b": "02"}
    assert workers_disagree(first, dict(first)) == ""
    assert workers_disagree(first, {"a": "01"}) == "did not receive tensor 'b'"
    assert workers_disagree(first, {**first, "c": "03"}) == "received tensor 'c', which the first worker did not"
    assert workers_disagree(first, {"a": "01", "b": "ff"}) == "received tensor 'b' with checksum ff instead of 02"
