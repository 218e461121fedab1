"""router.config: one schema for file, env and flags; bad input names its path and the fix."""

from __future__ import annotations

from pathlib import Path

import pytest

from router.config import ConfigError, HealthConfig, load_config, parse_config

ROOT = Path(__file__).resolve().parents[1]

MINIMAL = """
[[pools]]
model = "m"
[[pools.replicas]]
name = "a"
url = "http://127.0.0.1:9"
event_endpoint = "tcp://127.0.0.1:5557"
replay_endpoint = "tcp://127.0.0.1:5558"
dp_ranks = [0, 1, 2]
"""


@pytest.mark.parametrize("name", ["router-sim.toml", "router-vllm.toml"])
def test_example_configs_load(name: str) -> None:
    cfg = load_config(ROOT / "config" / name, environ={})
    assert cfg.pools and all(p.replicas for p in cfg.pools)


def test_dp_ranks_offset_ports_like_vllm() -> None:
    cfg = parse_config(MINIMAL)
    streams = cfg.pools[0].replicas[0].stream_list()
    assert [s.endpoint for s in streams] == [f"tcp://127.0.0.1:{5557 + r}" for r in range(3)]
    assert [s.replay_endpoint for s in streams] == [f"tcp://127.0.0.1:{5558 + r}" for r in range(3)]


def test_precedence_flags_over_env_over_file(tmp_path: Path) -> None:
    f = tmp_path / "r.toml"
    f.write_text("[server]\nport = 7000\nmax_attempts = 2\n" + MINIMAL)
    assert load_config(f, environ={}).server.port == 7000
    env = {"KVROUTER_PORT": "7001", "KVROUTER_INDEX_MAX_BYTES": "2097152"}
    cfg = load_config(f, environ=env)
    assert (cfg.server.port, cfg.index.max_bytes, cfg.server.max_attempts) == (7001, 2097152, 2)
    assert load_config(f, environ=env, flags={"port": 7002, "host": None}).server.port == 7002
    env = {"KVROUTER_TTFB_TIMEOUT_S": "5", "KVROUTER_HEADER_TIMEOUT_S": "2.5"}
    s = load_config(f, environ=env).server
    assert (s.ttfb_timeout_s, s.header_timeout_s, s.ttfb_timeout_nonstream_s) == (5, 2.5, 600)


def test_health_env_overrides_and_example_defaults(tmp_path: Path) -> None:
    f = tmp_path / "r.toml"
    f.write_text("[health]\nprobe_interval_s = 5.0\n" + MINIMAL)
    env = {"KVROUTER_HEALTH_PROBE_INTERVAL_S": "0.5", "KVROUTER_HEALTH_EJECT_AFTER_FAILURES": "4"}
    h = load_config(f, environ=env).health
    assert (h.probe_interval_s, h.eject_after_failures, h.unhealthy_threshold) == (0.5, 4, 2)
    with pytest.raises(ConfigError, match=r"\$\.health"):
        load_config(f, environ={"KVROUTER_HEALTH_UNHEALTHY_THRESHOLD": "0"})
    # the example files spell out the defaults
    for name in ("router-sim.toml", "router-vllm.toml"):
        assert load_config(ROOT / "config" / name, environ={}).health == HealthConfig()


@pytest.mark.parametrize(
    ("text", "needles"),
    [
        ("[server]\nport = 'x'\n" + MINIMAL, ["Expected `int`", "$.server.port"]),
        ("[server]\nprot = 1\n" + MINIMAL, ["unknown field `prot`", "$.server"]),
        ("[server]\nmax_attempts = 0\n" + MINIMAL, ["max_attempts", "$.server"]),
        ("", ["no pools"]),
        ("[[pools]]\nmodel='m'\n", ["replicas", "$.pools[0]"]),
        (MINIMAL.replace("http://", "ftp://"), ["http://", "$.pools[0].replicas[0]"]),
        (MINIMAL.replace("tcp://127.0.0.1:5557", "tcp://nowhere"), ["$.pools[0].replicas[0]"]),
        (MINIMAL + "[pools.tokenizer]\nstrategy='local'\n", ["path", "$.pools[0].tokenizer"]),
        (MINIMAL + "[pools.tokenizer]\nstrategy='magic'\n", ["$.pools[0].tokenizer.strategy"]),
        (
            MINIMAL + "[pools.layout]\ngroups=[{kind='sliding_window', block_size=16}]\n",
            ["sliding_window", "$.pools[0]"],
        ),
        (
            MINIMAL + "[pools.layout]\ngroups=[{kind='full_attention', block_size=16, x=1}]\n",
            ["unknown field `x`", "$.pools[0].layout.groups[0]"],
        ),
        (MINIMAL + "[pools.policy]\ntemperature=-1\n", ["temperature", "$.pools[0].policy"]),
        (MINIMAL + MINIMAL, ["served by two pools"]),
        (
            MINIMAL + '[[pools.replicas]]\nname="a"\nurl="http://x"\n',
            ["unique", "$.pools[0]"],
        ),
        ("[server\n", ["not valid TOML"]),
        ("[index]\nmax_groups = 0\n" + MINIMAL, ["max_groups", "$.index"]),
        ("[server]\nttfb_timeout_s = 0\n" + MINIMAL, ["ttfb_timeout_s", "> 0", "$.server"]),
        ("[server]\nttfb_timeout_nonstream_s = nan\n" + MINIMAL, ["ttfb_timeout_nonstream_s"]),
        ("[server]\nheader_timeout_s = inf\n" + MINIMAL, ["header_timeout_s", "$.server"]),
        ("[server]\nheader_timeout_s = -1\n" + MINIMAL, ["header_timeout_s", "$.server"]),
        ("[server]\nkeep_alive_s = 0\n" + MINIMAL, ["keep_alive_s", "> 0", "$.server"]),
        ("[server]\nkeep_alive_s = inf\n" + MINIMAL, ["keep_alive_s", "$.server"]),
        ("[server]\nmax_header_bytes = 100\n" + MINIMAL, ["max_header_bytes", ">= 1024"]),
        ("[index]\nmax_block_size = -1\n" + MINIMAL, ["max_block_size", "$.index"]),
    ],
)
def test_bad_config_names_file_path_and_reason(text: str, needles: list[str]) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(text, source="bad.toml")
    msg = str(info.value)
    assert msg.startswith("bad.toml: ")
    for n in needles:
        assert n in msg, msg


def test_bad_env_value_is_reported_with_its_field(tmp_path: Path) -> None:
    f = tmp_path / "r.toml"
    f.write_text(MINIMAL)
    with pytest.raises(ConfigError, match=r"\$\.server\.port"):
        load_config(f, environ={"KVROUTER_PORT": "eighty"})


@pytest.mark.parametrize("section", ["server = 5", "server = [1]", "server = 'x'"])
def test_a_section_that_is_not_a_table_under_env_overrides_is_a_config_error(
    tmp_path: Path, section: str
) -> None:
    f = tmp_path / "r.toml"
    f.write_text(section + "\n" + MINIMAL)
    with pytest.raises(ConfigError, match=r"`server` must be a table \(\[server\]\).*sets? port"):
        load_config(f, environ={"KVROUTER_PORT": "8001"})


def test_an_override_of_a_field_the_section_lacks_is_refused_by_name() -> None:
    with pytest.raises(ConfigError, match="unknown field `capacity`"):
        parse_config(MINIMAL, overrides={"index": {"capacity": "5"}})


def test_missing_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "nope.toml", environ={})


def test_redacted_hides_admin_token() -> None:
    cfg = parse_config('[server]\nadmin_token = "s3cret"\n' + MINIMAL)
    assert "s3cret" not in str(cfg.redacted())


def test_index_bounds_reach_the_index_limits() -> None:
    cfg = parse_config("[index]\nmax_groups = 8\nmax_block_size = 512\n" + MINIMAL)
    limits = cfg.index.limits()
    assert (limits.max_groups, limits.max_block_size, limits.max_bytes) == (8, 512, 1 << 30)
