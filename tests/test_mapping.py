"""Pure mapping math: fusing, TP sharding, vocabulary padding and name tables (no megatron needed)."""

import pytest
import torch

from rlplacement.families import megatron_mapping as mapping
from rlplacement.families import all_families, family_for
from rlplacement.families.base import Fused

SHAPE = mapping.ModelShape(num_layers=2, hidden_size=8, num_heads=4, num_query_groups=2, head_dim=3,
                           vocab_size=300, padded_vocab_size=384, tied=False)


def _qkv():
    q = torch.randn(SHAPE.num_heads * SHAPE.head_dim, SHAPE.hidden_size)
    k = torch.randn(SHAPE.num_query_groups * SHAPE.head_dim, SHAPE.hidden_size)
    v = torch.randn(SHAPE.num_query_groups * SHAPE.head_dim, SHAPE.hidden_size)
    return q, k, v


def test_qkv_fused_in_grouped_query_layout_and_split_back_bit_exact():
    q, k, v = _qkv()
    fused = mapping.fuse_qkv(q, k, v, SHAPE)
    d, qpg = SHAPE.head_dim, SHAPE.q_per_group
    # group 1 starts after group 0's 2 q heads + k + v; its first rows are q head 2
    group1 = fused[(qpg + 2) * d:]
    assert torch.equal(group1[:d], q[2 * d:3 * d])
    assert torch.equal(group1[qpg * d:(qpg + 1) * d], k[d:2 * d])
    assert torch.equal(group1[(qpg + 1) * d:], v[d:])
    for a, b in zip(mapping.split_qkv(fused, SHAPE), (q, k, v)):
        assert torch.equal(a, b)


def test_qkv_bias_fuses_like_the_weight():
    q, k, v = (t[:, 0].contiguous() for t in _qkv())
    back = mapping.split_qkv(mapping.fuse_qkv(q, k, v, SHAPE), SHAPE)
    assert all(torch.equal(a, b) for a, b in zip(back, (q, k, v)))


@pytest.mark.parametrize("name,pdim", [
    ("decoder.layers.0.mlp.linear_fc1.weight", 0), ("decoder.layers.1.self_attention.linear_qkv.weight", 0),
    ("decoder.layers.0.self_attention.linear_proj.weight", 1), ("decoder.layers.0.mlp.linear_fc2.weight", 1),
    ("embedding.word_embeddings.weight", 0), ("decoder.layers.0.input_layernorm.weight", None)])
def test_tp_shards_reassemble_bit_exact(name, pdim):
    assert mapping.tp_partition_dim(name) == pdim
    full = torch.randn(8, 6)
    shards = [mapping.tp_shard(name, full, pdim, 2, r) for r in range(2)]
    assert torch.equal(mapping.tp_unshard(name, shards, pdim), full)


def test_fc1_shard_holds_its_slice_of_gate_and_of_up():
    gate, up = torch.arange(8.).reshape(4, 2), 100 + torch.arange(8.).reshape(4, 2)
    shard1 = mapping.tp_shard("decoder.layers.0.mlp.linear_fc1.weight", torch.cat([gate, up]), 0, 2, 1)
    assert torch.equal(shard1, torch.cat([gate[2:], up[2:]]))


def test_vocab_padding_rule_and_strip_on_export():
    assert mapping.padded_vocab_size(300, 1) == 384
    assert mapping.padded_vocab_size(300, 2) == 512
    assert mapping.padded_vocab_size(256, 2) == 256
    fam = family_for(type("C", (), {"model_type": "qwen3"})())
    emb = torch.randn(300, 8)
    padded = mapping.hf_to_megatron("embedding.word_embeddings.weight", {"model.embed_tokens.weight": emb}.__getitem__,
                                    SHAPE, fam)
    assert padded.shape == (384, 8) and torch.equal(padded[:300], emb) and not padded[300:].any()
    [(name, back)] = mapping.megatron_to_hf("embedding.word_embeddings.weight", padded, SHAPE, fam)
    assert name == "model.embed_tokens.weight" and torch.equal(back, emb)


def test_tied_output_layer_reads_the_embedding_and_exports_nothing():
    import dataclasses

    tied = dataclasses.replace(SHAPE, tied=True)
    fam = all_families()[0]
    emb = torch.randn(300, 8)
    out = mapping.hf_to_megatron("output_layer.weight", {"model.embed_tokens.weight": emb}.__getitem__, tied, fam)
    assert torch.equal(out[:300], emb)
    assert mapping.megatron_to_hf("output_layer.weight", out, tied, fam) == []


def test_te_fused_norm_names_and_local_norm_names_map_to_the_same_hf_tensor():
    fam = all_families()[0]
    for te, local in (("self_attention.linear_qkv.layer_norm_weight", "input_layernorm.weight"),
                      ("mlp.linear_fc1.layer_norm_weight", "pre_mlp_layernorm.weight")):
        a = mapping.hf_sources(mapping.megatron_layer_name(3, te), fam)
        assert a == mapping.hf_sources(mapping.megatron_layer_name(3, local), fam)
        assert a.startswith("model.layers.3.")
    src = mapping.hf_sources("decoder.layers.1.mlp.linear_fc1.weight", fam)
    assert src == Fused("fc1", ("model.layers.1.mlp.gate_proj.weight", "model.layers.1.mlp.up_proj.weight"))


def test_megatron_names_cover_every_hf_tensor_of_each_family():
    for fam in (f for f in all_families() if not f.moe):
        for te in (False, True):
            hf = set()
            for m in mapping.megatron_names(SHAPE, fam, qkv_bias=fam.name == "qwen2", te_spec=te):
                src = mapping.hf_sources(m, fam)
                hf.update(src.hf if isinstance(src, Fused) else [src])
            assert ("model.layers.1.self_attn.q_norm.weight" in hf) == (fam.name == "qwen3")
            assert ("model.layers.0.self_attn.q_proj.bias" in hf) == (fam.name == "qwen2")
            assert {"model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"} <= hf
            assert len(hf) == 3 + 2 * (9 + {"qwen3": 2, "qwen2": 3, "llama": 0}[fam.name])


def test_unknown_family_and_unsupported_features_are_named():
    with pytest.raises(ValueError, match="model_type 'gpt2' has no mapping; known: llama, qwen2, qwen3"):
        family_for(type("C", (), {"model_type": "gpt2"})())
    with pytest.raises(ValueError, match="rope type 'yarn' is not supported"):
        family_for(type("C", (), {"model_type": "llama", "rope_parameters": {"rope_type": "yarn"}})())
    with pytest.raises(KeyError, match="no HF mapping for Megatron parameter"):
        mapping.hf_sources("decoder.layers.0.mlp.router.weight", all_families()[0])


@pytest.mark.parametrize("groups", [2, 1])
def test_hf_views_are_views_equal_to_the_export_and_name_the_grouped_ones(groups):
    """The colocated direct path reads the parameters in place: every HF tensor a view of the fused
    parameter, q/k/v of several query groups as [groups, rows, ...] whose C order is the HF tensor's;
    the export is the same tensors, contiguous in their HF shapes."""
    import dataclasses

    shape = dataclasses.replace(SHAPE, num_query_groups=groups)
    fam = family_for(type("C", (), {"model_type": "qwen2"})())
    d, kv = shape.head_dim, groups * shape.head_dim
    q, k, v = torch.randn(shape.num_heads * d, 8), torch.randn(kv, 8), torch.randn(kv, 8)
    gate, up, emb = torch.randn(6, 8), torch.randn(6, 8), torch.randn(300, 8)
    cases = {  # megatron name -> (full tensor, the HF tensors it holds)
        "decoder.layers.1.self_attention.linear_qkv.weight": (mapping.fuse_qkv(q, k, v, shape), [q, k, v]),
        "decoder.layers.1.self_attention.linear_qkv.bias": (mapping.fuse_qkv(q[:, 0], k[:, 0], v[:, 0], shape),
                                                            [q[:, 0], k[:, 0], v[:, 0]]),
        "decoder.layers.0.mlp.linear_fc1.weight": (torch.cat([gate, up]), [gate, up]),
        "embedding.word_embeddings.weight": (torch.cat([emb, torch.zeros(84, 8)]), [emb])}
    for mname, (full, want) in cases.items():
        got = mapping.hf_views(mname, full, shape, fam)
        exported = mapping.megatron_to_hf(mname, full, shape, fam)
        assert [n for n, _, _ in got] == [n for n, _ in exported] and len(got) == len(want)
        for (name, view, hf_shape), (_, out), expected in zip(got, exported, want):
            assert view.untyped_storage().data_ptr() == full.untyped_storage().data_ptr(), name  # no copy
            grouped = "linear_qkv" in mname and groups > 1
            assert (hf_shape is not None) == grouped, name
            assert torch.equal(view.reshape(expected.shape), expected), name
            assert out.is_contiguous() and torch.equal(out, expected), name
            if grouped:
                assert hf_shape == tuple(expected.shape) and view.shape[0] == groups and not view.is_contiguous()


def test_moe_names_cover_every_hf_tensor_once_with_global_expert_indices():
    """Qwen3-MoE with a dense layer between sparse ones: every megatron name maps to HF names of its own
    layer and expert, together exactly the checkpoint's tensors (per-expert names, the router as
    ``mlp.gate``); a rank's local expert index is made global before the lookup."""
    fam = family_for(type("C", (), {"model_type": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 2,
                                    "num_hidden_layers": 2})())
    assert fam.moe
    sparse = [True, False]
    for te in (False, True):
        hf = []
        for m in mapping.megatron_names(SHAPE, fam, qkv_bias=False, te_spec=te, sparse=sparse, experts=4):
            src = mapping.hf_sources(m, fam)
            hf.extend(src.hf if isinstance(src, Fused) else [src])
        assert len(hf) == len(set(hf))
        experts = {n for n in hf if ".experts." in n}
        assert experts == {f"model.layers.0.mlp.experts.{e}.{p}_proj.weight" for e in range(4)
                           for p in ("gate", "up", "down")}
        assert "model.layers.0.mlp.gate.weight" in hf and "model.layers.1.mlp.gate_proj.weight" in hf
        assert len(hf) == 3 + (8 + 1 + 12) + 11  # globals, sparse layer (attention and norms, router, experts), dense
    assert mapping.hf_sources("decoder.layers.0.mlp.experts.local_experts.3.linear_fc1.weight", fam) == Fused(
        "fc1", ("model.layers.0.mlp.experts.3.gate_proj.weight", "model.layers.0.mlp.experts.3.up_proj.weight"))
    assert mapping.global_expert_name("mlp.experts.local_experts.1.linear_fc2.weight", 2) == \
        "mlp.experts.local_experts.3.linear_fc2.weight"
    assert mapping.tp_partition_dim("decoder.layers.0.mlp.experts.local_experts.1.linear_fc1.weight") == 0
    assert mapping.tp_partition_dim("decoder.layers.0.mlp.experts.local_experts.1.linear_fc2.weight") == 1
    assert mapping.tp_partition_dim("decoder.layers.0.mlp.router.weight") is None


def test_moe_family_reads_which_layers_are_sparse_as_hf_does():
    from rlplacement.families import MoEFamily

    cfg = type("C", (), {"num_hidden_layers": 6, "decoder_sparse_step": 2, "mlp_only_layers": [3]})()
    assert MoEFamily.sparse_layers(cfg) == [False, True, False, False, False, True]
    fam = family_for(type("C", (), {"model_type": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 2,
                                    "num_hidden_layers": 2})())
    for fields, message in (({"num_experts_per_tok": 5}, "num_experts_per_tok 5 must be between 1 and num_experts 4"),
                            ({"shared_expert_intermediate_size": 64}, "shared experts are not supported"),
                            ({"mlp_only_layers": [0, 1]}, "no layer is sparse")):
        cfg = type("C", (), {"model_type": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 2,
                             "num_hidden_layers": 2, **fields})()
        with pytest.raises(ValueError, match=message):
            fam.check(cfg)
