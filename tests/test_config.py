import pytest
import yaml

from configs import Config, ConfigError, load_config, to_dict

pytestmark = pytest.mark.unit


def test_defaults_then_file_then_command_line(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("seed: 5\ntrain:\n  lr: 1.0e-3\n  steps: 7\nmodel:\n  dim: 64\n")
    cfg = load_config(f, ["train.lr=3e-4", "checkpoint.async=true"])
    assert cfg.seed == 5 and cfg.train.steps == 7 and cfg.model.dim == 64  # from the file
    assert cfg.train.lr == 3e-4 and cfg.checkpoint.async_ is True  # the command line wins
    assert cfg.train.global_batch == Config().train.global_batch  # defaults fill the rest


def test_the_shipped_configs_load():
    tiny = load_config("configs/tiny.yaml")
    assert tiny.model.seq_len == 128
    small = load_config("configs/minimind2_small.yaml")
    assert (small.model.dim, small.model.n_layers, small.model.n_heads, small.model.n_kv_heads) == (512, 8, 8, 2)


@pytest.mark.parametrize("override, match", [
    ("train.lrr=1", "unknown key 'train.lrr'"),
    ("nosuch=1", "unknown key 'nosuch'"),
    ("train.steps=many", r"train.steps: expected int, got 'many'"),
    ("log.sample_ids=3", r"log.sample_ids: expected bool"),
    ("dist.reduce=fastest", r"dist.reduce: expected one of ddp, canonical, got 'fastest'"),
    ("checkpoint.keep=1", r"checkpoint.keep: expected at least 2"),
    ("model.n_heads=3", r"model.dim \(128\) must be divisible by model.n_heads \(3\)"),
    ("train.steps", "expected key=value"),
    ("train.grpo.scale_rewards=false", r"train.grpo.scale_rewards: expected one of 'group', 'batch', 'none', got 'false'"),
    ("data.resume_seq_len=yes", r"data.resume_seq_len: expected one of refuse, repack, got 'true'"),
    ("train.lr=nan", r"train.lr: expected a finite number, got 'nan'"),
    ("train.beta1=.nan", r"train.beta1: expected a finite number, got nan"),
    ("model.rope_theta=.inf", r"model.rope_theta: expected a finite number, got inf"),
    ("train.grad_clip=-inf", r"train.grad_clip: expected a finite number, got '-inf'"),
    ("model.rope_scaling.factor=1e999", r"model.rope_scaling.factor: expected a finite number, got '1e999'"),
    ("seed=18446744073709551616", r"seed: expected an integer that fits in 64 bits, got 18446744073709551616"),
    ("train.lr=1e300", r"train.lr: expected a number within float32's range \(at most 3.403e\+38 in size\), got '1e300'"),
    ("runtime.threads=4294967296", r"runtime.threads: expected 0 \(the default\) to 4096 threads, got 4294967296"),
    ("dist.timeout_s=2147483648", r"dist.timeout_s: expected 1 to 2147483647 seconds \(a C int\), got 2147483648"),
    ("data.mix={a: 1, a: 2}", r"command line: data.mix: key 'a' is given twice \(first at line 1\); say it once"),
])
def test_a_bad_override_is_an_error_naming_the_key_and_what_was_expected(override, match):
    with pytest.raises(ConfigError, match=match):
        load_config(None, [override])


def test_a_bad_file_is_an_error_naming_the_file(tmp_path):
    f = tmp_path / "bad.yaml"
    f.write_text("train:\n  stepz: 3\n")
    with pytest.raises(ConfigError, match=r"bad.yaml: unknown key 'train.stepz'"):
        load_config(f)
    f.write_text("- a list\n")
    with pytest.raises(ConfigError, match=r"bad.yaml: expected a mapping"):
        load_config(f)
    with pytest.raises(ConfigError, match=r"missing.yaml does not exist"):
        load_config(tmp_path / "missing.yaml")
    with pytest.raises(ConfigError, match=r"config file .* is a directory \(expected a YAML file"):
        load_config(tmp_path)
    with pytest.raises(ConfigError, match=r"config file /dev/null is not a regular file \(expected a YAML file\)"):
        load_config("/dev/null")
    f.write_text("train:\n  lr: 1e-3\n  steps: 3\n  lr: 2e-3\n")  # YAML keeps the last one silently
    with pytest.raises(ConfigError, match=r"bad.yaml: line 4: key 'lr' is given twice \(first at line 2\)"):
        load_config(f)
    f.write_bytes(b"train:\n  lr: \xff\n")
    with pytest.raises(ConfigError, match=r"bad.yaml: not UTF-8 text \(byte 13 is 0xff\)"):
        load_config(f)


def test_the_resolved_config_round_trips_through_yaml(tmp_path):
    cfg = load_config("configs/tiny.yaml", ["train.steps=3", "checkpoint.async=true", "train.lr=1e-4"])
    f = tmp_path / "resolved.yaml"
    f.write_text(yaml.safe_dump(to_dict(cfg)))
    assert to_dict(load_config(f)) == to_dict(cfg)
    assert "async" in yaml.safe_load(f.read_text())["checkpoint"]


def test_an_unparsable_environment_override_or_a_value_nested_too_deeply_is_bad_input_naming_where(tmp_path, monkeypatch):
    monkeypatch.setenv("MINIMIND_OVERRIDES", "seed='1")
    with pytest.raises(ConfigError, match=r"MINIMIND_OVERRIDES: No closing quotation"):
        load_config(None)
    monkeypatch.delenv("MINIMIND_OVERRIDES")
    with pytest.raises(ConfigError, match=r"command line: seed: the value is nested too deeply"):
        load_config(None, ["seed=" + "[" * 5000 + "]" * 5000])
    f = tmp_path / "deep.yaml"
    f.write_text("seed: " + "[" * 5000 + "]" * 5000 + "\n")
    with pytest.raises(ConfigError, match=r"deep.yaml: nested too deeply to be a config"):
        load_config(f)
