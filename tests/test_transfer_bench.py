"""``rlplacement bench``: a small real run prints the contract's fields; bad input is refused."""

import json

import pytest
import torch

from rlplacement import cli

FIELDS = {"mode", "bytes", "num_tensors", "seconds", "gbps", "ceiling", "ceiling_gbps", "ratio"}


def test_bench_prints_one_json_row_per_mode(capsys):
    assert cli.main(["bench", "--size-mb", "4", "--num-tensors", "47", "--bucket-mb", "1", "--repeats", "1",
                     "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["mode"] for r in rows] == ["broadcast", "broadcast_packed", "p2p", "cuda_ipc"]  # registration order
    for r in rows:
        assert FIELDS <= set(r)
        assert r["num_tensors"] == 47 and r["bytes"] > 2e6
        assert r["ceiling"] == {"cuda_ipc": "raw in-memory copy", "p2p": "raw Mooncake write"}.get(r["mode"],
                                                                                                 "flat broadcast")
        assert r["gbps"] == pytest.approx(r["bytes"] / r["seconds"] / 1e9) and 0 < r["ratio"]
        low, mid, high = r["ratio_per_round_quartiles"]
        assert 0 < low <= mid <= high
        # no GPU here: --device auto measured the CPU transports and says so
        assert r["transport"] == {"cuda_ipc": "shared memory", "p2p": "mooncake tcp"}.get(r["mode"], "gloo")


@pytest.mark.parametrize("argv,message", [(["--mode", "pigeon"], "--mode 'pigeon' has no benchmark"),
                                          (["--size-mb", "0"], "--size-mb must be positive")]
                         + ([] if torch.cuda.is_available() else
                            [(["--device", "cuda", "--size-mb", "1"], "--device cuda: no CUDA GPU is visible")]))
def test_bench_refuses_bad_input(argv, message, capsys):
    assert cli.main(["bench", *argv]) == 2
    assert message in capsys.readouterr().err
