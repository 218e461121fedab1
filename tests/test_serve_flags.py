"""``kvrouter serve`` without a file (``--model``/``--replica``/``--policy``/``--layout``/
``--tokenizer``), and ``kvrouter --version``.

The flags build the same data a file decodes to and go through the same validation, so the
config from flags equals the config from the equivalent file, and a bad value is refused with
the flag and the value the user typed. (tests/test_several_routers.py serves real traffic
through a router started from flags alone.)
"""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import msgspec
import pytest

from router.config import ConfigError, effective_overrides, parse_config
from router.config_flags import config_from_flags, default_replica_name, parse_replica
from router.version import UNKNOWN, kvrouter_version

ROOT = Path(__file__).resolve().parents[1]
KVROUTER = [sys.executable, "-m", "router.cli"]
LAYOUT = ROOT / "gpu_emitter" / "layout_files" / "fa_swa.toml"


def run(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*KVROUTER, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )


def test_flags_give_the_same_config_as_the_equivalent_file() -> None:
    from_flags = config_from_flags(
        "sim-fa-swa",
        [
            "http://127.0.0.1:8101,events=tcp://127.0.0.1:5601,replay=tcp://127.0.0.1:5611",
            "http://127.0.0.1:8102,events=tcp://127.0.0.1:5602,name=b,dp_ranks=0+1,"
            "dp_rank_header=X-data-parallel-rank,bind=true,topic=kv,metrics_path=none",
        ],
        policy="least_load",
        layout=str(LAYOUT),
        tokenizer="remote",
        overrides=effective_overrides({}, {"port": 9100}),
    )
    text = """
[server]
port = 9100
[[pools]]
model = "sim-fa-swa"
[pools.policy]
name = "least_load"
[pools.tokenizer]
strategy = "remote"
[pools.layout]
retention_interval = 0
[pools.layout.hash]
algo = "sha256"
int_block_hashes = true
[[pools.layout.groups]]
kind = "full_attention"
block_size = 16
[[pools.layout.groups]]
kind = "sliding_window"
block_size = 16
sliding_window = 128
[[pools.replicas]]
name = "127.0.0.1-8101"
url = "http://127.0.0.1:8101"
event_endpoint = "tcp://127.0.0.1:5601"
replay_endpoint = "tcp://127.0.0.1:5611"
[[pools.replicas]]
name = "b"
url = "http://127.0.0.1:8102"
event_endpoint = "tcp://127.0.0.1:5602"
dp_ranks = [0, 1]
dp_rank_header = "X-data-parallel-rank"
bind = true
topic = "kv"
"""
    from_file = parse_config(text)
    # TOML cannot say metrics_path = None; everything else is the same config
    assert from_flags.pools[0].replicas[1].metrics_path is None
    rep_b = from_flags.pools[0].replicas[1]
    same_b = msgspec.structs.replace(rep_b, metrics_path="/metrics")
    pool = msgspec.structs.replace(
        from_flags.pools[0], replicas=(from_flags.pools[0].replicas[0], same_b)
    )
    assert msgspec.structs.replace(from_flags, pools=(pool,)) == from_file


def test_defaults_are_the_schemas() -> None:
    cfg = config_from_flags("m", ["http://10.0.0.7:8000"])
    (pool,) = cfg.pools
    assert pool.policy.name == "kv" and pool.tokenizer.strategy == "builtin"
    assert pool.layout.groups == ()  # learned from the first events
    assert pool.replicas[0].name == "10.0.0.7-8000" and pool.replicas[0].event_endpoint is None
    assert cfg.server == parse_config('[[pools]]\nmodel = "m"\nreplicas = []\n').server


@pytest.mark.parametrize(
    ("url", "name"),
    [
        ("http://10.0.0.7:8000", "10.0.0.7-8000"),
        ("http://vllm-0.vllm.ns.svc:8000/", "vllm-0.vllm.ns.svc-8000"),
        ("http://[::1]:8101", "1-8101"),
        ("http://example", "example-80"),
    ],
)
def test_default_names_are_host_and_port(url: str, name: str) -> None:
    assert default_replica_name(url) == name
    assert parse_replica(url)["name"] == name


def test_local_tokenizer_is_a_directory() -> None:
    cfg = config_from_flags("m", ["http://h:1"], tokenizer="/models/m")
    assert cfg.pools[0].tokenizer.strategy == "local"
    assert cfg.pools[0].tokenizer.path == "/models/m"


@pytest.mark.parametrize(
    ("replicas", "kwargs", "said"),
    [
        (["htp://h:1"], {}, "--replica 'htp://h:1': url 'htp://h:1' must start with http://"),
        (["http://h:1,events=h:5557"], {}, "--replica 'http://h:1,events=h:5557': endpoint 'h"),
        (["http://h:1,dp_ranks=0+x"], {}, "dp_ranks='0+x': list ranks joined by '+'"),
        (["http://h:1,dp_ranks=0+-1"], {}, "--replica 'http://h:1,dp_ranks=0+-1': dp_ranks must"),
        (["http://h:1,bind=maybe"], {}, "bind='maybe': write true or false"),
        (["http://h:1,colour=red"], {}, "unknown option 'colour=red'"),
        (["http://h:1,name=a,name=b"], {}, "name given twice"),
        (["http://h:1,name=a b"], {}, "--replica 'http://h:1,name=a b': replica name 'a b'"),
        (["events=tcp://h:1"], {}, "start with the replica's URL"),
        (["http://h:1", "http://h:1"], {}, "replica names must be unique"),
        (["http://h:1,topic=1,metrics_path=/m"], {"layout": "/no/such.toml"},
         "--layout '/no/such.toml': cannot read the layout file"),
        (["http://h:1"], {"layout": str(ROOT / "config/router-sim.toml")},
         "unknown field `server`"),
    ],
)  # fmt: skip
def test_refusals_name_the_flag_and_its_value(replicas, kwargs, said) -> None:
    with pytest.raises(ConfigError) as info:
        config_from_flags("m", replicas, **kwargs)
    assert said in str(info.value)


def test_bad_layout_file_is_named(tmp_path: Path) -> None:
    bad = tmp_path / "layout.toml"
    bad.write_text('[[groups]]\nkind = "sliding_window"\nblock_size = 16\n')
    with pytest.raises(ConfigError, match=r"--layout '.*layout.toml': .*no sliding_window"):
        config_from_flags("m", ["http://h:1"], layout=str(bad))


# -- the command ---------------------------------------------------------------------------


def test_serve_check_from_flags() -> None:
    p = run("serve", "--check", "--model", "m", "--policy", "round_robin", "--layout",
            str(LAYOUT), "--replica", "http://127.0.0.1:8101,events=tcp://127.0.0.1:5601",
            "--replica", "http://127.0.0.1:8102")  # fmt: skip
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "flags: ok (1 pool(s), 2 replica(s))"


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["--config", "config/router-sim.toml", "--model", "m"],
         "give either --config FILE or the quick-start flags, not both (--model given"),
        (["--config", "config/router-sim.toml", "--policy", "kv"], "(--policy given with"),
        ([], "no config: give --config FILE, or --model and at least one --replica "
             "(missing --model and --replica"),
        (["--model", "m"], "(missing --replica"),
        (["--replica", "http://h:1"], "(missing --model"),
        (["--model", "m", "--replica", "http://h:1", "--port", "70000"], "port must be 0..65535"),
        (["--model", "m", "--replica", "http://h:1", "--host", "0.0.0.0"],
         "admin API enabled on non-loopback host"),
    ],
)  # fmt: skip
def test_serve_refuses_with_exit_2(args: list[str], said: str) -> None:
    p = run("serve", "--check", *args)
    assert p.returncode == 2
    assert said in p.stderr, p.stderr


def test_help_says_file_or_flags() -> None:
    p = run("serve", "--help")
    assert p.returncode == 0
    assert "Either --config FILE or --model" in p.stdout
    assert "kvrouter config example" in p.stdout


def test_version_is_the_installed_distributions() -> None:
    p = run("--version")
    assert p.returncode == 0
    assert p.stdout.strip() == f"kvrouter {version('kvrouter')}"
    assert kvrouter_version() == version("kvrouter") != UNKNOWN


def test_openapi_version_is_the_packages() -> None:
    from router.server.app import create_app

    app = create_app(config_from_flags("m", ["http://127.0.0.1:9"]))
    assert app.fastapi.openapi()["info"]["version"] == kvrouter_version()


def test_version_falls_back_when_not_installed() -> None:
    code = (
        "import importlib.metadata as m\n"
        "def missing(name):\n"
        "    raise m.PackageNotFoundError(name)\n"
        "m.version = missing\n"
        "from router.version import kvrouter_version\n"
        "print(kvrouter_version())\n"
    )
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == UNKNOWN
