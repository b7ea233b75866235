"""Config layering (defaults < TOML < env < kwargs) and errors that name the key."""

import pytest

from twisternet.config import Config, load_config, parse_size, to_env
from twisternet.errors import ConfigError


def test_layers_in_order(tmp_path):
    f = tmp_path / "tn.toml"
    f.write_text('buffer_size = "2MiB"\ntimeout = 10\nbuffer_count = 3\n')
    env = {"TWISTERNET_CONFIG": str(f), "TWISTERNET_TIMEOUT": "20", "TWISTERNET_FORCE_TCP": "yes"}
    c = load_config(env=env, buffer_count=5)
    assert c.buffer_size == 2 << 20          # from the file
    assert c.timeout == 20.0                  # env beats file
    assert c.buffer_count == 5                # kwargs beat everything
    assert c.force_tcp is True
    assert c.pool_buffers == Config().pool_buffers  # default


def test_table_form(tmp_path):
    f = tmp_path / "tn.toml"
    f.write_text("[twisternet]\nprogress = 'manual'\n")
    assert load_config(f, env={}).progress == "manual"


@pytest.mark.parametrize("kwargs,key", [
    ({"bufer_size": 1}, "bufer_size"),
    ({"buffer_size": 10}, "buffer_size"),
    ({"buffer_size": "lots"}, "buffer_size"),
    ({"timeout": -1}, "timeout"),
    ({"progress": "sometimes"}, "progress"),
    ({"channel": "carrier-pigeon"}, "channel"),
    ({"force_tcp": "perhaps"}, "force_tcp"),
    ({"master": "nohostport"}, "master"),
    ({"rank": 4, "world": 4}, "rank"),
    ({"token": "short"}, "token"),
    ({"heartbeat_interval": 30, "peer_timeout": 10}, "heartbeat_interval"),
    ({"buffer_count": 2.5}, "buffer_count"),
])
def test_bad_values_name_the_key(kwargs, key):
    with pytest.raises(ConfigError) as e:
        load_config(env={}, **kwargs)
    assert e.value.key == key and key in str(e.value)


def test_unknown_env_and_file_keys(tmp_path):
    with pytest.raises(ConfigError, match="TWISTERNET_NOPE"):
        load_config(env={"TWISTERNET_NOPE": "1"})
    f = tmp_path / "x.toml"
    f.write_text("nope = 1\n")
    with pytest.raises(ConfigError, match="nope"):
        load_config(f, env={})
    f.write_text("not toml = = =\n")
    with pytest.raises(ConfigError, match="TOML"):
        load_config(f, env={})
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.toml", env={})


def test_sizes():
    assert parse_size("k", "4MiB") == 4 << 20 and parse_size("k", "1.5k") == 1500 and parse_size("k", 7) == 7
    with pytest.raises(ConfigError):
        parse_size("k", "4 parsecs")


def test_frozen_replace_and_env_round_trip():
    c = load_config(env={}, timeout=7, force_tcp=True)
    with pytest.raises(AttributeError):   # a frozen dataclass
        c.timeout = 3  # type: ignore[misc]
    assert c.replace(timeout=9).timeout == 9
    with pytest.raises(ConfigError):
        c.replace(nonsense=1)
    assert load_config(env=to_env(c)) == c


def test_variables_that_are_not_config_keys_are_left_to_their_readers():
    """Launcher and tool variables (token file/dir, master port, Kubernetes service, the coflow trace) may
    be set in a job's environment without being taken for unknown config keys; a typo still is one."""
    from twisternet.config import ENV_LAUNCH_VARS, load_config
    env = {name: "x" for name in ENV_LAUNCH_VARS}
    assert load_config(env=env) == load_config(env={})
    with pytest.raises(ConfigError, match="coflow_trcae"):
        load_config(env={"TWISTERNET_COFLOW_TRCAE": "x"})
