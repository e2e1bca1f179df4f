"""``osd serve`` on the command line: its help and flags, the limits it builds from them
(the API key also from ``OSD_API_KEY``), its errors (a busy port, fastapi missing), and a
real process serving a completion and stopping cleanly on Ctrl-C.
"""

import subprocess
import sys
import time

import pytest

fastapi = pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from osd import cli, zoo  # noqa: E402
from osd.server import Limits  # noqa: E402
from osd.server.run import limits_from_args, stream_interval_s, torch_threads  # noqa: E402
from tests.server_harness import PROMPTS, free_socket  # noqa: E402


def test_cli_serve_help_and_errors(capsys, monkeypatch):
    with pytest.raises(SystemExit):
        cli.main(["serve", "--help"])
    out = capsys.readouterr().out
    assert "--max-batch-size" in out and "--online" in out and "--port" in out

    target, draft = zoo.default_pair()
    with free_socket() as busy:
        busy.listen()
        rc = cli.main(["serve", "--target", target, "--port", str(busy.getsockname()[1])])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("error: cannot listen") and "Traceback" not in err

    monkeypatch.setitem(sys.modules, "fastapi", None)  # as if not installed
    assert cli.main(["serve", "--target", target]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "pip install osd[serve]" in err


def test_cli_serve_end_to_end():
    """``osd serve`` as a process: up (its speculation settings printed), one completion,
    then a clean Ctrl-C."""
    target, draft = zoo.default_pair()
    with free_socket() as s:
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "osd.cli",
            "serve",
            "--target",
            target,
            "--draft",
            draft,
            "--port",
            str(port),
            "--max-seq-len",
            "128",
            "--log-level",
            "warning",
            "--threads",
            "1",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        client = openai.OpenAI(
            base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=30
        )
        deadline = time.time() + 60
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None, proc.stdout.read()
            assert time.time() < deadline, "osd serve did not come up"
            time.sleep(0.2)
        assert client.models.list().data[0].id == "target"
        r = client.completions.create(
            model="target", prompt=PROMPTS[0], max_tokens=4, temperature=0
        )
        assert r.usage.completion_tokens == 4 and r.choices[0].finish_reason == "length"
    finally:
        proc.send_signal(2)  # SIGINT: uvicorn shuts down
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    out = proc.stdout.read()
    assert proc.returncode == 0, out
    assert "osd serve: speculation num_draft_tokens=4; draft in float" in out  # its settings


def test_serve_flags_and_the_environment_key(capsys, monkeypatch):
    with pytest.raises(SystemExit):
        cli.main(["serve", "--help"])
    out = capsys.readouterr().out
    for flag in (
        "--api-key",
        "--allowed-origins",
        "--max-body-bytes",
        "--max-prompt-chars",
        "--max-waiting",
        "--max-connections",
        "--keep-alive-timeout",
        "--header-timeout",
        "--body-timeout",
    ):
        assert flag in out, flag
    args = cli.build_parser().parse_args(
        ["serve", "--max-waiting", "3", "--allowed-origins", "http://a.example, http://b.example"]
    )
    monkeypatch.setenv("OSD_API_KEY", "from-env")
    limits = limits_from_args(args)
    assert limits.api_key == "from-env" and limits.max_waiting == 3
    assert limits.allowed_origins == ("http://a.example", "http://b.example")
    assert limits.max_body_bytes == Limits().max_body_bytes
    monkeypatch.delenv("OSD_API_KEY")
    assert limits_from_args(args).api_key is None
    with pytest.raises(ValueError):
        Limits(header_timeout=0)


def test_cli_serve_stream_interval():
    parse = cli.build_parser().parse_args
    assert stream_interval_s(parse(["serve"])) == pytest.approx(0.02)  # the CPU's default
    assert stream_interval_s(parse(["serve", "--device", "cuda"])) == 0.0
    assert stream_interval_s(parse(["serve", "--stream-interval", "0"])) == 0.0
    assert stream_interval_s(parse(["serve", "--stream-interval", "5"])) == pytest.approx(0.005)
    with pytest.raises(ValueError, match="--stream-interval"):
        stream_interval_s(parse(["serve", "--stream-interval", "-1"]))


def test_cli_serve_threads_beside_a_learner():
    """``--online`` on the CPU serves on half the cores: torch's thread count is the
    process's, and the learner trains on as many threads as serving."""
    parse = cli.build_parser().parse_args
    assert torch_threads(parse(["serve"]), online=False) is None  # torch's default
    assert torch_threads(parse(["serve", "--online"]), online=True, cores=2) == 1
    assert torch_threads(parse(["serve", "--online"]), online=True, cores=16) == 8
    assert torch_threads(parse(["serve", "--online"]), online=True, cores=1) == 1
    assert torch_threads(parse(["serve", "--online", "--threads", "2"]), online=True) == 2
    cuda = parse(["serve", "--online", "--device", "cuda"])
    assert torch_threads(cuda, online=True, cores=16) is None
