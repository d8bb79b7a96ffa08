import math
import os

import pytest
import torch

from model import MiniMindLM, ModelConfig

pytestmark = pytest.mark.unit

CFG = ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, seq_len=16)


def test_forward_gives_logits_of_batch_by_time_by_vocab():
    torch.manual_seed(0)
    m = MiniMindLM(CFG)
    x = torch.randint(0, 256, (3, 16))
    logits, loss = m(x)
    assert logits.shape == (3, 16, CFG.vocab_size) and loss is None


def test_changing_a_token_leaves_every_earlier_position_unchanged():
    torch.manual_seed(0)
    m = MiniMindLM(CFG).eval()
    x = torch.randint(0, 256, (1, 16))
    t = 9
    y = x.clone()
    y[0, t] = (y[0, t] + 1) % 256
    a, _ = m(x)
    b, _ = m(y)
    assert torch.equal(a[0, :t], b[0, :t])
    assert not torch.allclose(a[0, t:], b[0, t:])


def test_loss_equals_a_hand_computed_cross_entropy():
    torch.manual_seed(0)
    m = MiniMindLM(CFG)
    x, y = torch.randint(0, 256, (2, 16)), torch.randint(0, 256, (2, 16))
    logits, loss = m(x, y)
    logp = logits.double().log_softmax(-1)
    hand = -logp.gather(-1, y.unsqueeze(-1)).mean()
    assert math.isclose(loss.item(), hand.item(), rel_tol=3e-7)  # fp32 vs fp64: measured 3.4e-8 relative here
    # and before any training it is close to the uniform guess
    assert abs(loss.item() - math.log(CFG.vocab_size)) < 0.5


def test_grouped_query_attention_has_fewer_key_value_heads_than_query_heads():
    m = MiniMindLM(ModelConfig(dim=64, n_layers=1, n_heads=8, n_kv_heads=2, seq_len=8))
    att = m.layers[0].attention
    assert att.wq.weight.shape == (64, 64)
    assert att.wk.weight.shape == att.wv.weight.shape == (2 * 8, 64)
    logits, _ = m(torch.randint(0, 256, (2, 8)))
    assert logits.shape == (2, 8, 259)


def test_grouped_attention_equals_full_attention_with_repeated_key_value_weights_bit_for_bit():
    torch.manual_seed(0)
    gqa = MiniMindLM(ModelConfig(dim=32, n_layers=1, n_heads=4, n_kv_heads=2, seq_len=8)).eval()
    mha = MiniMindLM(ModelConfig(dim=32, n_layers=1, n_heads=4, n_kv_heads=4, seq_len=8)).eval()
    sd = gqa.state_dict()
    hd = 8
    for k in ("wk", "wv"):
        w = sd[f"layers.0.attention.{k}.weight"].view(2, hd, 32)
        sd[f"layers.0.attention.{k}.weight"] = w.repeat_interleave(2, dim=0).reshape(4 * hd, 32)
    mha.load_state_dict(sd)
    x = torch.randint(0, 256, (2, 8))
    assert torch.equal(gqa(x)[0], mha(x)[0])  # the same products in the same order: equal, not close


def test_embedding_is_tied_to_the_output_head_and_counted_once():
    m = MiniMindLM(CFG)
    d, v, h, kv = CFG.dim, CFG.vocab_size, CFG.ffn_dim, CFG.n_kv_heads * (CFG.dim // CFG.n_heads)
    per_layer = d * d + 2 * d * kv + d * d + 3 * d * h + 2 * d  # wq, wk+wv, wo, SwiGLU w1 w2 w3, two RMSNorms
    assert m.num_parameters() == v * d + CFG.n_layers * per_layer + d  # one embedding matrix, the final norm
    # Tied in training too: the head's gradient lands on the embedding's one tensor.
    x = torch.randint(0, 256, (2, 16))
    _, loss = m(x, x)
    loss.backward()
    head_only = torch.zeros(v, dtype=torch.bool)
    head_only[torch.tensor(sorted(set(range(v)) - set(x.flatten().tolist())))] = True
    assert m.tok_embeddings.weight.grad[head_only].abs().sum() > 0  # rows no input used: only the head touched them


def test_dropout_is_off_by_default_and_draws_from_the_seeded_generator_when_on():
    x = torch.randint(0, 256, (2, 16))
    torch.manual_seed(0)
    m = MiniMindLM(ModelConfig(**{**CFG.__dict__, "dropout": 0.2}))
    torch.manual_seed(5)
    a, _ = m(x)
    torch.manual_seed(5)
    b, _ = m(x)
    torch.manual_seed(6)
    c, _ = m(x)
    assert torch.equal(a, b) and not torch.equal(a, c)
    # In eval mode dropout is off: the output is the same model's without dropout, whatever the generator says.
    m.eval()
    plain = MiniMindLM(CFG).eval()
    plain.load_state_dict(m.state_dict())
    torch.manual_seed(7)
    assert torch.equal(m(x)[0], plain(x)[0])


@pytest.mark.parametrize("bad, key", [({"dim": 30}, "model.dim"), ({"n_kv_heads": 3}, "model.n_heads"), ({"dropout": 1.0}, "model.dropout")])
def test_an_impossible_shape_is_an_error_naming_the_key(bad, key):
    with pytest.raises(ValueError, match=key):
        ModelConfig(**{**CFG.__dict__, **bad})


@pytest.mark.unit
def test_the_trainer_and_the_tools_put_mkl_in_its_reproducible_mode_unless_the_user_chose_one(monkeypatch):
    """Without MKL_CBWR, oneMKL's AVX-512 branch on 2 threads gave another step-1 gradient in about
    one run in seven of the same command on this VM; AVX2,STRICT gave the same bits every run
    (common/kernels.py). train.main and the tools' main set it first; a user's own value stays."""
    import train
    from common import kernels

    assert "avx2" in open("/proc/cpuinfo").read(), "the CI machine is an x86 with AVX2"
    monkeypatch.delenv("MKL_CBWR", raising=False)
    with pytest.raises(SystemExit):
        train.main(["--help"])
    assert os.environ["MKL_CBWR"] == kernels.MKL_REPRODUCIBLE == "AVX2,STRICT"
    monkeypatch.setenv("MKL_CBWR", "AUTO")
    kernels.reproducible_kernels()
    assert os.environ["MKL_CBWR"] == "AUTO"
