"""The LoRA row of the colocated run (``colocate_h200.py --lora-rank 32``): an adapter-only update of rank N on
every decoder linear layer of a shape (alpha 2N), one GPU, four rows on the same engine and bytes:

* ``adapter_slots`` (ours): a trainer stand-in's adapter tensors (its GPU memory) sent by ``cuda_ipc`` into our
  engine, written into the idle LoRA slot and switched to (``rlplacement.engines.vllm.adapter_slots``), timed
  as ``transfer_driver.run_update`` returns: the loop's update less the trainer's own gather of its adapters.
* ``vllm_lora_folder``: vLLM's own load of the same adapter from a PEFT folder (``LoRARequest`` with a path:
  the worker manager's ``add_adapter`` reads it on the host, packs and scales it, ``set_lora`` into a slot),
  timed inside the worker (the folder is in the page cache after the first load).
* ``vllm_lora_tensors``: vLLM's own load from the same tensors on the GPU (``LoRAModel.from_lora_tensors`` to
  host, ``add_adapter``, ``activate_adapter``): what live updates did before the slots, timed inside the worker.
* the ceiling: one device-to-device copy of the adapter's bytes (CUDA events).

Checks: every row's served slot bytes (every linear LoRA layer's A and B views of the slot serving the adapter)
equal those after ``vllm_lora_folder``, vLLM's fresh load of the same tensors; our update is also checked tensor
by tensor as received; greedy generation after our update equals generation after vLLM's folder load (prompts
shorter than a KV block, so no prefix-cache hit joins the two).
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

from rlplacement.engines.vllm.live_lora import ADAPTER_ID, ADAPTER_NAME
from rlplacement.engines.vllm.vllm_worker import RlplacementWorkerExtension
from rlplacement.runtime.trainer_transfer import TrainerTransferMixin
from rlplacement.transfer.base import tensor_checksum

MODES = ("adapter_slots", "vllm_lora_folder", "vllm_lora_tensors")
PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8], [100, 200, 250, 120], [7] * 12]  # each under one KV block
LORA_BENCH_EXTENSION = f"{__name__}.LoraBenchWorkerExtension"


def write_adapter(folder: Path, model_dir: Path, rank: int, alpha: float) -> dict:
    """A PEFT folder of random bf16 adapters (``A`` and ``B`` both non-zero) on every decoder linear layer;
    its bytes and tensor count."""
    import torch
    from safetensors.torch import save_file

    from rlplacement.config import LORA_MODULES
    from rlplacement.lora_format import adapter_shapes

    shapes = adapter_shapes(json.loads((model_dir / "config.json").read_text()), rank, LORA_MODULES)
    g = torch.Generator().manual_seed(0)
    tensors = {n: (torch.randn(s, generator=g) * 0.02).to(torch.bfloat16) for n, s in shapes.items()}
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": alpha,
                                                            "target_modules": list(LORA_MODULES)}))
    return {"bytes": sum(t.numel() * t.element_size() for t in tensors.values()), "num_tensors": len(tensors)}


class AdapterTrainer(TrainerTransferMixin):
    """Holds a PEFT folder's tensors on its GPU, as a trainer holds its adapters after a step."""

    def __init__(self, folder: str):
        import torch

        from rlplacement.lora_format import read_adapter_folder

        self.tensors = {n: t.to("cuda") for n, t in read_adapter_folder(folder).items()}
        torch.cuda.synchronize()

    def hf_named_tensors(self):
        yield from self.tensors.items()


class LoraBenchWorkerExtension(RlplacementWorkerExtension):
    """vLLM's own adapter loads and the served slot's checksums, on the engine's worker."""

    def _lora_bench_manager(self):
        return self.model_runner.lora_manager._adapter_manager

    def lora_bench_served(self) -> dict[str, str]:
        from rlplacement.engines.vllm.adapter_slots import served_slot_tensors

        manager = self._lora_bench_manager()
        ids = manager.lora_index_to_id
        return {k: tensor_checksum(t) for k, t in served_slot_tensors(manager, ids.index(ADAPTER_ID)).items()} \
            if ADAPTER_ID in ids else {}

    def lora_bench_load_folder(self, folder: str, repeats: int) -> list[float]:
        """Seconds of each of ``repeats`` loads of ``folder`` by vLLM, under the live adapter's id and name."""
        import torch
        from vllm.lora.request import LoRARequest

        times = []
        for _ in range(repeats):
            self._lora_bench_manager().remove_adapter(ADAPTER_ID)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            self.model_runner.lora_manager.add_adapter(LoRARequest(ADAPTER_NAME, ADAPTER_ID, folder))
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        return times

    def lora_bench_load_tensors(self, folder: str, rank: int, alpha: float, target_modules: list,
                                repeats: int) -> list[float]:
        """Seconds of each of ``repeats`` loads by vLLM of ``folder``'s tensors, put on the GPU first (untimed)."""
        import torch
        from vllm.lora.lora_model import LoRAModel
        from vllm.lora.peft_helper import PEFTHelper

        from rlplacement.lora_format import read_adapter_folder

        wm = self.model_runner.lora_manager
        manager = self._lora_bench_manager()
        staged = [(n, t.to("cuda")) for n, t in read_adapter_folder(folder).items()]
        helper = PEFTHelper.from_dict({"r": rank, "lora_alpha": alpha, "target_modules": list(target_modules)})
        times = []
        for _ in range(repeats):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            tensors = {n: t.clone() for n, t in staged}  # vLLM scales B in place
            model = LoRAModel.from_lora_tensors(ADAPTER_ID, tensors, helper, device="cpu",
                                                dtype=wm.lora_config.lora_dtype, model_vocab_size=wm.vocab_size)
            manager.remove_adapter(ADAPTER_ID)
            manager.add_adapter(model)
            manager.activate_adapter(ADAPTER_ID)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        return times


def run_size(size: str, root: Path, args, compare_generation: bool) -> dict:
    import common
    import ray

    from rlplacement.args import build_parser, config_from_args
    from rlplacement.config import LORA_MODULES
    from rlplacement.engines.ray_engines import create_engine_actor
    from rlplacement.placement import ray_groups
    from rlplacement.runtime import transfer_driver as driver
    from rlplacement.runtime.waits import get_all

    t0 = time.time()
    model_dir = common.make_model(root, size, "bfloat16")
    rank, alpha = args.lora_rank, 2.0 * args.lora_rank
    folder = root / f"{size}_adapter_r{rank}"
    shape = write_adapter(folder, model_dir, rank, alpha)
    utilization = args.gpu_memory_utilization or 0.3
    row: dict = {"size": size, "lora_rank": rank, "lora_alpha": alpha, "make_model_s": round(time.time() - t0, 1),
                 "gpu_memory_utilization": utilization, **shape,
                 "start": "trainer GPU memory (adapter tensors, bf16); vLLM's folder row from the page cache"}
    spec = {"rank": rank, "alpha": alpha, "target_modules": list(LORA_MODULES)}
    config = config_from_args(build_parser().parse_args(["--colocate", "--actor-num-gpus-per-node", "1",
                                                         "--num-gpus-per-node", "1", "--train-backend", "fsdp"]))
    placement = ray_groups.place(config.placement)
    trainer = ray.remote(AdapterTrainer).options(**placement.trainer_options(0)).remote(str(folder))
    engine = create_engine_actor(0, str(model_dir), options=placement.engine_options(0), live_lora=spec,
                                 worker_extension_cls=LORA_BENCH_EXTENSION, dtype="bfloat16", max_model_len=512,
                                 gpu_memory_utilization=utilization, enforce_eager=args.eager)
    served = lambda: get_all([engine.call_workers.remote("lora_bench_served")], 300, "served slot")[0][0]  # noqa: E731
    try:
        get_all([engine.info.remote(), trainer.hf_tensors_resident.remote()], 900, "engine and trainer start")
        version = 0

        def update(check: bool) -> dict:
            nonlocal version
            version += 1
            t0 = time.perf_counter()
            result = driver.run_update(trainer, [engine], version, timeout_s=300, check_equal=check)
            return {"whole": time.perf_counter() - t0, "wire": result.trainer.seconds, "load": result.engines[0].load}

        ray.get(trainer.transfer_setup.remote("cuda_ipc", args.buffer_size, check_equal=True, timeout_s=300))
        driver.connect(trainer, [engine], timeout_s=300)
        update(True)  # registered and activated through vLLM: later updates take the slot path
        update(True)  # the first through the slots, checked tensor by tensor as received
        ours_served = served()
        ours_greedy = common.greedy(engine, PROMPTS) if compare_generation else None
        runs = [update(False) for _ in range(args.repeats + 1)][1:]
        row["adapter_slots"] = {"whole": [r["whole"] for r in runs], "wire": [r["wire"] for r in runs],
                                "load": [r["load"] for r in runs],
                                "commit": get_all([engine.call_workers.remote("rlplacement_load_path")], 60,
                                                  "path")[0][0]}

        folder_s = get_all([engine.call_workers.remote("lora_bench_load_folder", str(folder), args.repeats + 1)],
                           900, "vLLM folder loads")[0][0][1:]
        fresh_served = served()
        row["vllm_lora_folder"] = {"whole": folder_s, "wire": [None], "load": folder_s}
        if compare_generation:
            fresh_greedy = common.greedy(engine, PROMPTS)
            row["generation_tokens_equal"] = all(a["token_ids"] == b["token_ids"]
                                                 for a, b in zip(ours_greedy, fresh_greedy))
            row["generation_logprob_max_abs_diff"] = max(abs(x - y) for a, b in zip(ours_greedy, fresh_greedy)
                                                         for x, y in zip(a["logprobs"], b["logprobs"]))
        tensors_s = get_all([engine.call_workers.remote("lora_bench_load_tensors", str(folder), rank, alpha,
                                                        list(LORA_MODULES), args.repeats + 1)],
                            900, "vLLM tensor loads")[0][0][1:]
        tensors_served = served()
        row["vllm_lora_tensors"] = {"whole": tensors_s, "wire": [None], "load": tensors_s}
        update(False)  # ours again, over vLLM's registered adapter
        again_served = served()
        for mode, sums in (("adapter_slots", ours_served), ("vllm_lora_folder", fresh_served),
                           ("vllm_lora_tensors", tensors_served)):
            row[mode]["bit_exact"] = bool(sums) and sums == fresh_served
            row[mode]["bit_exact_scope"] = (f"every linear LoRA layer's served slot views ({len(sums)}) against "
                                            f"vLLM's own load of the same folder")
        row["adapter_slots"]["bit_exact"] &= again_served == fresh_served
        for mode in MODES:
            print(f"[{size}] {mode}: whole {statistics.median(row[mode]['whole']) * 1e3:.2f} ms, "
                  f"bit-exact {row[mode]['bit_exact']}", flush=True)
    finally:
        try:
            get_all([engine.shutdown.remote()], 120, "engine shutdown")
        except Exception as exc:  # noqa: BLE001 - killed below either way
            print(f"[{size}] engine shutdown: {exc}", flush=True)
        for actor in (engine, trainer):
            ray.kill(actor)
        placement.remove()
    row["bytes"], row["num_tensors"] = shape["bytes"], shape["num_tensors"]
    copies = common.device_copy_seconds(row["bytes"], args.repeats)
    return common.size_row(row, copies, "device-to-device copy of the adapter's bytes (moved once)", MODES)
