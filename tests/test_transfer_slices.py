"""Engine workers that receive only their slice of each tensor (``transfer.shards``), over the real wire: p2p
(Mooncake over loopback TCP) into receiver threads, each keeping another slice; and the pure parts (the
worker's keeps from vLLM's rules, the view the loader is handed, the check of what a loader read)."""

import pytest
import torch

from rlplacement.transfer import shards
from rlplacement.transfer.base import TransferError, tensor_checksum
from tests.test_transfer_broadcast import Session, _bytes, _model, _scaled

# worker 0 and worker 1 of a 2-wide engine, on _model's tensors: q by rows (heads), up_proj (a transposed
# tensor, so its slice is not contiguous in the trainer's memory) by columns as a row-parallel layer is;
# k, v and the norms whole
KEEPS = [{f"model.layers.{i}.self_attn.q_proj.weight": ((w * 16, w * 16 + 16), (0, 16)) for i in range(3)}
         | {f"model.layers.{i}.mlp.up_proj.weight": ((0, 40), (w * 8, w * 8 + 8)) for i in range(3)}
         for w in range(2)]


def _box(t, box):
    return shards.cut(t, box)


@pytest.mark.parametrize("buffer_size", [4096, 1 << 20])
def test_p2p_writes_each_worker_only_its_slices_bit_exact_over_versions_and_replays(buffer_size):
    s = Session("p2p", buffer_size=buffer_size, check_equal=True, keeps=KEEPS)
    try:
        named = _model(1)
        whole_bytes = sum(t.numel() * t.element_size() for _, t in named)
        for version in (1, 2, 3):
            report, send_error, errors = s.run(version, named)
            assert send_error is None and errors == [None, None]
            assert report.path == ("buckets" if version == 1 else "replay")
            for w, (receiver, applied) in enumerate(zip(s.receivers, s.applied)):
                got = dict(applied)
                assert set(got) == {n for n, _ in named}
                for name, src in named:
                    box = KEEPS[w].get(name)
                    assert got[name].shape == src.shape
                    assert torch.equal(_bytes(_box(got[name], box)), _bytes(_box(src, box))), name
                kept = sum(_box(t, KEEPS[w].get(n)).numel() * t.element_size() for n, t in named)
                assert receiver.received_bytes == kept < whole_bytes
                assert set(receiver.sliced) == set(KEEPS[w])
                # what each worker checks is its own slices, under the keys the trainer reported
                assert receiver.verified_checksums == {
                    shards.region_key(n, KEEPS[w].get(n)): tensor_checksum(_box(t, KEEPS[w].get(n))) for n, t in named}
                assert set(receiver.verified_checksums) <= set(report.checksums)
            named = _scaled(named, 1.5)
    finally:
        s.close()


def test_a_corrupted_slice_is_refused_by_its_checksum_and_the_version_kept(monkeypatch):
    s = Session("p2p", check_equal=True, keeps=KEEPS)
    try:
        named = _model(1)
        report, send_error, errors = s.run(1, named)
        assert send_error is None and errors == [None, None]
        receiver = s.receivers[1]
        unpack = type(receiver)._unpack

        def corrupt(self, buf, manifest):
            if self is receiver:
                buf.view(torch.uint8)[0] ^= 0xFF
            return unpack(self, buf, manifest)

        monkeypatch.setattr(type(receiver), "_unpack", corrupt)
        report, send_error, errors = s.run(2, _scaled(named, 2.0))
        assert errors[0] is None and "checksum" in str(errors[1])
        assert [r.version for r in s.receivers] == [2, 1]
    finally:
        s.close()


def test_a_worker_keeps_vllms_slices_of_the_tensors_tp_cuts():
    config = {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "hidden_size": 64,
              "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
              "num_hidden_layers": 1, "vocab_size": 100, "tie_word_embeddings": False, "rms_norm_eps": 1e-6}
    keeps = [shards.keeps_for_worker(config, w, 4) for w in range(4)]
    p = "model.layers.0."
    assert keeps[1][p + "self_attn.q_proj.weight"] == ((32, 64), (0, 64))
    assert keeps[3][p + "self_attn.o_proj.weight"] == ((0, 64), (96, 128))
    assert keeps[2][p + "mlp.gate_proj.weight"] == ((64, 96), (0, 64))
    # 2 KV heads over 4 workers: each worker keeps one head, replicated on two workers
    assert keeps[0][p + "self_attn.k_proj.weight"] == keeps[1][p + "self_attn.k_proj.weight"] == ((0, 32), (0, 64))
    # the vocabulary padded to 128 and split by 32 rows: worker 3's rows 96..127 are past 100 but 96..99
    assert keeps[3]["model.embed_tokens.weight"] == ((96, 100), (0, 64))
    assert all(p + "input_layernorm.weight" not in k for k in keeps)  # norms go whole
    assert shards.keeps_for_worker(config, 0, 1) == {}


@pytest.mark.parametrize("box", [((2, 5), (0, 6)), ((0, 7), (1, 4)), ((0, 7), (0, 6), (3, 5))])
def test_the_loader_gets_the_whole_shape_with_the_slice_in_its_box(box):
    shape = (7, 6) if len(box) == 2 else (7, 6, 5)
    whole = torch.arange(torch.Size(shape).numel(), dtype=torch.float32).reshape(shape)
    view = shards.full_view(shards.cut(whole, box).contiguous(), box, shape)
    assert view.shape == whole.shape
    assert torch.equal(shards.cut(view, box), shards.cut(whole, box))
    sliced = {"t": (box, shape)}
    d = shards.sliced_dim(box, shape)
    exact = (box[d][0] * view.stride()[d], shards.box_shape(box), tuple(view.stride()))
    assert shards.misread({"t": [exact]}, sliced, {"t": view.stride()}) is None
    assert "read 't' other than as its slice" in shards.misread({"t": [(0, shape, view.stride())]}, sliced,
                                                                   {"t": view.stride()})
    assert "took nothing of 't'" in shards.misread({}, sliced, {"t": view.stride()})


def test_a_mode_that_broadcasts_refuses_slices():
    from rlplacement.transfer import registry

    with pytest.raises(TransferError, match="mode 'broadcast' sends every worker whole tensors"):
        registry.receiver_class("broadcast")("cpu").keep_slices(KEEPS[0])
