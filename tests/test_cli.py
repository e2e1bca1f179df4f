"""The ``osd`` console script: help texts, generation on the built-in pair, and errors
reported as one ``error:`` line with exit status 2 (no traceback)."""

import json
import shutil

import pytest
import torch

import osd
from osd import cli, zoo
from osd.demo import DemoConfig, _command, run_demo
from osd.models.quant import QuantLinear
from tests.test_gguf import T, tiny_hf_model, to_gguf


@pytest.mark.parametrize(
    "argv", [["--help"], ["demo", "--help"], ["generate", "--help"], ["bench", "--help"]]
)
def test_help(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: osd")
    if argv[0] == "generate":
        assert "--prompt-lookup" in out and "--online" in out


@pytest.mark.parametrize(
    "extra",
    [
        [],
        ["--prompt-lookup", "--lookup-tokens", "8"],
        ["--online"],
        ["--repetition-penalty", "1.3", "--presence-penalty", "0.5"],
    ],
    ids=["spec", "lookup", "online", "penalties"],
)
def test_generate_on_the_zoo_pair(extra, capsys):
    target, draft = zoo.default_pair()
    rc = cli.main(
        [
            "generate",
            "--target",
            target,
            "--draft",
            draft,
            "--max-new-tokens",
            "12",
            *extra,
            "def __init__(self, name):\n    self.name = name\n",
        ]
    )
    assert rc == 0
    captured = capsys.readouterr()
    assert captured.out.strip()  # the decoded continuation
    assert "12 tokens" in captured.err and "acceptance" in captured.err


@pytest.mark.parametrize(
    "extra,k,fmt",
    [([], 2, "Q8_0"), (["-k", "3"], 3, "Q8_0"), (["--quantize-draft", "none"], 2, None)],
)
def test_generate_takes_the_drafts_recommended_settings(
    tmp_path, monkeypatch, capsys, extra, k, fmt
):
    """Without speculation flags ``osd generate`` serves a draft with the settings its
    ``serving.json`` recommends; a flag builds the spec from the flags instead, and
    ``--quantize-draft none`` keeps the draft in float32."""
    target, draft = zoo.default_pair()
    mine = tmp_path / "draft"
    shutil.copytree(draft, mine)
    (mine / "serving.json").write_text(
        json.dumps(
            {"spec": {"num_draft_tokens": 2, "prompt_lookup": True}, "quantize_draft": "Q8_0"}
        )
    )
    engines = []
    load = osd.Engine.from_pretrained
    monkeypatch.setattr(
        osd.Engine,
        "from_pretrained",
        lambda *a, **kw: engines.append(load(*a, **kw)) or engines[-1],
    )
    assert (
        cli.main(
            [
                "generate",
                "--target",
                target,
                "--draft",
                str(mine),
                "--max-new-tokens",
                "8",
                *extra,
                "def add(a, b):",
            ]
        )
        == 0
    )
    (engine,) = engines
    assert engine.spec.num_draft_tokens == k
    assert engine.spec.prompt_lookup == (extra != ["-k", "3"])
    quantized = [m.fmt for m in engine.draft.modules() if isinstance(m, QuantLinear)]
    assert set(quantized) == ({fmt} if fmt else set())
    assert "8 tokens" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv,match",
    [
        (["generate", "--target", "/nonexistent/model", "hi"], "does not exist"),
        (
            ["generate", "--target", "TARGET", "--drafter", "ngram", "--prompt-lookup", "hi"],
            "already is prompt lookup",
        ),
        (
            ["generate", "--target", "TARGET", "--draft", "DRAFT", "-k", "0", "hi"],
            "num_draft_tokens must be in",
        ),
        (
            ["generate", "--target", "TARGET", "--draft", "DRAFT", "--lookup-tokens", "8", "hi"],
            "lookup_tokens shapes prompt lookup",
        ),
        (["generate", "--target", "TARGET", "--temperature", "-1", "hi"], "temperature"),
        (
            ["generate", "--target", "TARGET", "--repetition-penalty", "0", "hi"],
            "repetition_penalty",
        ),
        (["generate", "--target", "TARGET", "--stop", "", "hi"], "stop strings must not be empty"),
        (["bench", "--only", "nothing_like_this"], "no benchmark"),
        (
            ["demo", "--pair", "builtin", "--lookup-history", "1000"],
            "lookup_history needs prompt_lookup",
        ),
        (["demo", "--lookup-min-match", "4"], "lookup_min_match must be in 1..3"),
        (
            ["demo", "--pair", "builtin", "--lookup-min-match", "2"],
            "lookup_min_match needs prompt_lookup",
        ),
        (["demo", "--pair", "builtin", "--quantized"], "quantized needs the chat pair"),
        (["demo", "--pair", "builtin", "--plain-every", "0"], "plain_every must be >= 1"),
        (["generate", "--target", "TARGET", "--quantized", "hi"], "is not a GGUF file"),
    ],
)
def test_errors_are_messages(argv, match, capsys):
    target, draft = zoo.default_pair()
    argv = [target if a == "TARGET" else draft if a == "DRAFT" else a for a in argv]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and match in err
    assert "Traceback" not in err


def test_generate_stops_at_a_stop_string(capsys):
    target, draft = zoo.default_pair()
    prompt = "def __init__(self, name):\n    self.name = name\n"
    assert cli.main(["generate", "--target", target, "--max-new-tokens", "24", prompt]) == 0
    free = capsys.readouterr().out.rstrip("\n")
    stop = free[len(free) // 2 : len(free) // 2 + 3]
    assert (
        cli.main(
            [
                "generate",
                "--target",
                target,
                "--draft",
                draft,
                "--max-new-tokens",
                "24",
                "--stop",
                stop,
                prompt,
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert stop in out and len(out.rstrip("\n")) < len(free)


def test_generate_quantized_gguf_equals_dequantized(tmp_path, capsys):
    path = str(to_gguf(tiny_hf_model("llama", seed=60), tmp_path / "m.gguf", T.Q4_1))
    outs = []
    for extra in ([], ["--quantized"]):
        assert (
            cli.main(["generate", "--target", path, "--max-new-tokens", "10", *extra, "1 2 3 4 5"])
            == 0
        )
        outs.append(capsys.readouterr().out)
    assert outs[0] == outs[1] and outs[0].strip()


def test_generate_kv_dtype(tmp_path, capsys, monkeypatch):
    """``--kv-dtype`` reaches ``from_pretrained`` (auto: None), and a float16 cache under
    the dequantized float32 model decodes."""
    path = str(to_gguf(tiny_hf_model("llama", seed=61), tmp_path / "m.gguf", T.Q4_1))
    seen = []
    real = osd.Engine.from_pretrained.__func__

    def spy(cls, *a, **kw):
        engine = real(cls, *a, **kw)
        seen.append((kw.get("kv_dtype"), engine.cache.kv.dtype))
        return engine

    monkeypatch.setattr(osd.Engine, "from_pretrained", classmethod(spy))
    for extra in (["--no-quantized", "--kv-dtype", "float16"], ["--kv-dtype", "float32"], []):
        argv = ["generate", "--target", path, "--max-new-tokens", "6", *extra, "1 2 3"]
        assert cli.main(argv) == 0
        assert capsys.readouterr().out.strip()
    assert seen[0] == ("float16", torch.float16) and seen[1] == ("float32", torch.float32)
    assert seen[2][0] is None
    with pytest.raises(SystemExit):
        cli.main(["generate", "--target", path, "--kv-dtype", "int8", "1 2"])


def test_demo_builtin_writes_the_report(tmp_path):
    out = tmp_path / "demo"
    rc = cli.main(
        [
            "demo",
            "--pair",
            "builtin",
            "--requests",
            "6",
            "--baseline",
            "2",
            "--static",
            "3",
            "--max-new-tokens",
            "8",
            "--out",
            str(out),
        ]
    )
    assert rc == 0
    for name in ("report.md", "summary.json", "alpha.png", "tokens_per_s.png", "speedup.png"):
        assert (out / name).is_file(), name
    report = (out / "report.md").read_text()
    assert "| online |" in report and "| target alone |" in report
    # the last 3 requests side by side; the target alone on one in 2 of them
    summary = json.loads((out / "summary.json").read_text())
    assert summary["summary"]["shared_requests"] == 2
    assert [r["request"] for r in summary["plain_window"]] == [3, 5]
    assert [r["request"] for r in summary["static"]] == [3, 4, 5]
    # every request's prefill timed apart: the speedup after the first token
    assert all(0 < r["prefill_seconds"] < r["seconds"] for r in summary["plain_window"])
    assert 0 < summary["summary"]["plain_prefill_share"] < 1
    assert summary["summary"]["online"]["decode_speedup_last"] > 0
    assert "speedup after the first token" in report


def test_demo_with_a_lookup_history(tmp_path):
    """The static pass's lookup history starts with the answers served before its
    requests, as the online pass had them; the report says so, and names lookup_tokens."""
    cfg = DemoConfig(
        pair="builtin",
        requests=6,
        baseline_requests=2,
        static_requests=3,
        max_new_tokens=8,
        prompt_lookup=True,
        lookup_history=4096,
        lookup_tokens=6,
        lookup_min_match=2,
        adaptive=True,
        out_dir=str(tmp_path / "demo"),
    )
    run_demo(cfg)
    report = (tmp_path / "demo" / "report.md").read_text()
    assert "4096 tokens of earlier answers" in report and "--lookup-history 4096" in report
    assert "up to 6 drafts" in report and "--lookup-tokens 6" in report
    assert "matches of 2+ tokens" in report and "--lookup-min-match 2" in report
    assert "--max-new-tokens 8" in report
    assert "stopping where the draft is unsure" in report and "--adaptive" in report


def test_demo_command_names_the_options_that_differ():
    """The report's command reproduces the run: the pair's defaults are left out, every
    other option is named (the CLI parses it back to the same DemoConfig)."""
    assert _command(DemoConfig()) == "osd demo --pair chat"
    cfg = DemoConfig(
        max_new_tokens=128,
        lookup_history=0,
        lookup_min_match=1,
        adaptive=True,
        quantize_draft="none",
        seed=3,
    )
    cmd = _command(cfg)
    assert cmd == (
        "osd demo --pair chat --quantize-draft none --lookup-history 0 "
        "--lookup-min-match 1 --adaptive --max-new-tokens 128 --seed 3"
    )
    args = cli.build_parser().parse_args(cmd.split()[1:])
    assert (
        args.max_new_tokens,
        args.lookup_history,
        args.lookup_min_match,
        args.adaptive,
        args.quantize_draft,
        args.seed,
    ) == (128, 0, 1, True, "none", 3)
    defaults = DemoConfig()
    assert (defaults.lookup_history, defaults.lookup_min_match) == (65536, 2)
    assert (
        DemoConfig(prompt_lookup=False, lookup_history=0, lookup_tree_below=0).lookup_min_match == 1
    )
    assert DemoConfig(adaptive=True).lookup_tree_below == 0
    assert (
        _command(DemoConfig(num_draft_tokens=4, lookup_tree_below=0))
        == "osd demo --pair chat --lookup-tree-below 0 -k 4"
    )
    assert (
        _command(DemoConfig(pair="builtin", quantize_draft="Q8_0", quantized=False, plain_every=1))
        == "osd demo --pair builtin --quantize-draft Q8_0 --plain-every 1"
    )


def test_demo_serves_a_quantized_draft_that_learns(tmp_path):
    """``quantize_draft``: the chat pair serves its draft in Q8_0 by default ("none":
    float32); the demo's online pass learns through it and the report says so."""
    assert DemoConfig(pair="chat").quantize_draft == "Q8_0"
    assert DemoConfig(pair="chat", quantize_draft="none").quantize_draft is None
    assert DemoConfig(pair="builtin").quantize_draft is None
    with pytest.raises(ValueError, match="quantize_draft must be one of"):
        DemoConfig(pair="builtin", quantize_draft="Q5_K")
    cfg = DemoConfig(
        pair="builtin",
        requests=6,
        baseline_requests=2,
        static_requests=3,
        max_new_tokens=8,
        quantize_draft="Q8_0",
        out_dir=str(tmp_path / "demo"),
    )
    run_demo(cfg)
    report = (tmp_path / "demo" / "report.md").read_text()
    assert "the draft served in Q8_0" in report and "--quantize-draft Q8_0" in report


def test_demo_bad_pair():
    with pytest.raises(SystemExit):
        cli.main(["demo", "--pair", "nonsense"])
