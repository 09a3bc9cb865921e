"""The ``tandem`` command line as argparse sees it: no abbreviated flags anywhere, every option's
help saying its default, one-line errors that name the flag and its bound, and the prompt read from
standard input or a file. In-process: nothing here reaches a running tandem (every check runs
before a command would connect)."""

from __future__ import annotations

import argparse
import io
import json
import math

import pytest
from pydantic import BaseModel, Field, ValidationError

from tandem import __version__
from tandem.cli.flags import Parser, field_bounds, invalid_value, parsers, shown_action_default
from tandem.cli.main import UsageError, main, parser, read_prompt, service_rows, services_table
from tandem.shared.protocol.serving import SamplingParams

EXPECTED = ["tandem", "tandem up", "tandem generate", "tandem train", "tandem console", "tandem services",
            "tandem bench serve", "tandem bench compare", "tandem serve",
            *(f"tandem serve {name}" for name in ("router", "prefill", "decode", "kvstore", "planner", "trainer",
                                                  "frontend"))]


@pytest.fixture(scope="module")
def by_prog() -> dict[str, argparse.ArgumentParser]:
    return {p.prog: p for p in parsers(parser())}


def options(p: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in p._actions if a.option_strings
            and not isinstance(a, argparse._HelpAction | argparse._VersionAction)]


def run_main(argv: list[str], capsys) -> tuple[int, str, str]:
    """``tandem ARGV`` in this process: (exit status, stdout, stderr)."""
    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    out = capsys.readouterr()
    return code, out.out, out.err


def test_the_walk_finds_every_command(by_prog):
    missing = [prog for prog in EXPECTED if prog not in by_prog]
    assert not missing, f"parsers() did not reach {missing}; found {sorted(by_prog)}"


@pytest.mark.parametrize("prog", EXPECTED)
def test_every_parser_refuses_abbreviations(by_prog, prog):
    p = by_prog[prog]
    assert isinstance(p, Parser), f"{prog} is a {type(p).__name__}"
    assert p.allow_abbrev is False, f"{prog} takes abbreviated flags"


@pytest.mark.parametrize("prog", EXPECTED)
def test_every_option_says_its_default(by_prog, prog):
    p = by_prog[prog]
    formatter = p._get_formatter()
    for action in options(p):
        shown = formatter._expand_help(action)  # the text --help prints, %-formatting done
        assert "default" in shown, f"{prog} {action.option_strings[0]}: help has no default: {shown!r}"
        if isinstance(action, argparse._StoreTrueAction):
            assert "default: off" in shown, f"{prog} {action.option_strings[0]}: a switch is off: {shown!r}"


@pytest.mark.parametrize(("prog", "flag", "ending"), [
    ("tandem generate", "--max-tokens", "(default: 64)"),
    ("tandem generate", "--temperature", "(default: 1.0)"),
    ("tandem generate", "--stop", "(default: none)"),
    ("tandem generate", "--json", "(default: off)"),
    ("tandem bench serve", "--num-prompts", "(default: 100)"),
    ("tandem bench compare", "--concurrency", "(default: 1 8 32 64)"),
    ("tandem services", "--wait", "(default: 0.5)"),
    ("tandem train", "--steps", "(default: 100; 200 with --default)"),  # TrainJob's, and --default's run
    ("tandem train", "--seq-len", "(default: 256)"),
])
def test_hand_written_flags_end_with_their_default(by_prog, prog, flag, ending):
    p = by_prog[prog]
    (action,) = [a for a in p._actions if flag in a.option_strings]
    assert p._get_formatter()._expand_help(action).endswith(ending), action.help


@pytest.mark.parametrize(("action_kwargs", "shown"), [
    (dict(action="store_true"), "off"),
    (dict(type=int, default=3), "3"),
    (dict(type=float, default=math.inf), "inf"),
    (dict(nargs="+", type=int, default=[1, 32]), "1 32"),
    (dict(action="append", default=[]), "none"),
    (dict(type=str), "unset"),
    (dict(nargs="?", const="x"), "off"),  # --demo [PROMPT]: left out, there is no demo
    (dict(default=""), "empty"),
])
def test_shown_defaults(action_kwargs, shown):
    action = argparse.ArgumentParser().add_argument("--x", **action_kwargs)
    assert shown_action_default(action) == shown


@pytest.mark.parametrize("argv", [
    ["generate", "--nat", "4", "x"],  # was --nats-url 4 (--n is a flag of its own now)
    ["generate", "x", "--max", "4"],
    ["bench", "serve", "--num", "3"],
    ["up", "--pre", "2"],
    ["train", "--ste", "5"],
    ["serve", "router", "--nats", "nats://x"],
    ["services", "--js"],
])
def test_abbreviated_flags_are_unrecognized(argv, capsys):
    code, _, err = run_main(argv, capsys)
    assert code == 2, f"tandem {' '.join(argv)} exited {code}: {err}"
    assert "unrecognized arguments" in err and len(err.splitlines()) == 1, err


def test_unrecognized_arguments_name_the_subcommand(capsys):
    code, _, err = run_main(["generate", "--nat", "4", "x"], capsys)
    assert (code, err) == (2, "tandem generate: unrecognized arguments: --nat x (see tandem generate --help)\n")


def test_version(capsys):
    code, out, _ = run_main(["--version"], capsys)
    assert (code, out) == (0, f"tandem {__version__}\n")


@pytest.mark.parametrize(("flags", "message"), [
    (["--top-p", "0"], "--top-p must be in (0, 1]"),
    (["--top-p", "1.5"], "--top-p must be in (0, 1]"),
    (["--temperature", "-1"], "--temperature must be in [0, 100]"),
    (["--temperature", "nan"], "--temperature must be in [0, 100]"),
    (["--temperature", "inf"], "--temperature must be in [0, 100]"),
    (["--top-k", "-2"], "--top-k must be in [-1, 2147483647]"),
    (["--max-tokens", "0"], "--max-tokens must be in [1, 2147483647]"),
    (["--seed", "-1"], "--seed must be in [0, 9223372036854775808)"),
    (["--stop", ""], "--stop must have at least 1 character"),
    (["--timeout", "0"], "--timeout must be > 0"),
    (["--top-k", "many"], "argument --top-k: invalid int value: 'many'"),
    (["--n", "0"], "--n must be in [1, 64]"),
    (["--n", "65"], "--n must be in [1, 64]"),
    (["--n", "3", "--best-of", "2"], "--best-of (2) must be at least --n (3)"),
    (["--best-of", "65"], "--best-of must be in [1, 64]"),
    (["--beam-width", "0"], "--beam-width must be in [1, 64]"),
    (["--beam-width", "2", "--n", "3"], "--n (3) must not exceed --beam-width (2)"),
    (["--beam-width", "2", "--best-of", "2"], "--best-of does not apply to beam search (--beam-width > 1)"),
    (["--beam-width", "2", "--stop", "x"], "--stop strings do not apply to beam search"),
    (["--beam-width", "2", "--length-penalty", "11"], "--length-penalty must be in [-10, 10]"),
    (["--length-penalty", "0.5"], "--length-penalty applies to beam search only (--beam-width > 1)"),
    (["--early-stopping", "true"], "--early-stopping applies to beam search only (--beam-width > 1)"),
    (["--early-stopping", "soon"], "argument --early-stopping: invalid choice: 'soon'"),
    (["--presence-penalty", "2.5"], "--presence-penalty must be in [-2, 2]"),
    (["--frequency-penalty", "-3"], "--frequency-penalty must be in [-2, 2]"),
    (["--repetition-penalty", "0"], "--repetition-penalty must be in (0, 100]"),
    (["--min-tokens", "-1"], "--min-tokens must be in [0, 2147483647]"),
    (["--min-tokens", "65"], "--min-tokens (65) must not exceed --max-tokens (64)"),
    (["--logit-bias", "5=101"], "--logit-bias must be less than or equal to 100"),
    (["--logit-bias", "5"], "argument --logit-bias: takes ID=BIAS (a token id and a number), not '5'"),
    (["--logit-bias", "a=1"], "argument --logit-bias: takes ID=BIAS (a token id and a number), not 'a=1'"),
    (["--logit-bias=-1=2"], "--logit-bias must be greater than or equal to 0"),
    (["--prompt-logprobs", "21", "--json"], "--prompt-logprobs must be in [0, 20]"),
    (["--prompt-logprobs", "2"], "--prompt-logprobs needs --json"),
    (["--logprobs", "2"], "--logprobs needs --json"),
    (["--priority", "101"], "--priority must be in [-100, 100]"),
    (["--priority", "-101"], "--priority must be in [-100, 100]"),
])
def test_generate_names_the_flag_and_its_bound(flags, message, capsys):
    code, out, err = run_main(["generate", "hello", *flags], capsys)
    assert code == 2 and out == ""
    assert err.startswith(f"tandem generate: {message}") and err.count("\n") == 1, err


def generate_params(*flags: str) -> dict:
    from tandem.cli.main import sampling_params

    return sampling_params(parser().parse_args(["generate", "x", *flags]))


DEFAULT_PARAMS = generate_params()


@pytest.mark.parametrize(("flags", "changed"), [
    ([], {}),
    (["--n", "3"], {"n": 3}),
    (["--n", "2", "--best-of", "5"], {"n": 2, "best_of": 5}),
    (["--beam-width", "4"], {"beam_width": 4}),
    (["--beam-width", "4", "--n", "2", "--length-penalty", "0.5", "--early-stopping", "never"],
     {"beam_width": 4, "n": 2, "length_penalty": 0.5, "early_stopping": "never"}),
    (["--beam-width", "2", "--early-stopping", "true"], {"beam_width": 2, "early_stopping": True}),
    (["--presence-penalty", "0.5", "--frequency-penalty", "-1"], {"presence_penalty": 0.5, "frequency_penalty": -1.0}),
    (["--repetition-penalty", "1.2"], {"repetition_penalty": 1.2}),
    (["--min-tokens", "5"], {"min_tokens": 5}),
    (["--logit-bias", "65=100", "--logit-bias", "10=-2.5"], {"logit_bias": [(65, 100.0), (10, -2.5)]}),
    (["--logprobs", "2", "--prompt-logprobs", "1", "--json"], {"logprobs": 2, "prompt_logprobs": 1}),
], ids=["defaults", "n", "best-of", "beams", "beam-knobs", "early-true", "presence-frequency", "repetition",
        "min-tokens", "logit-bias", "logprobs"])
def test_generate_flags_become_sampling_params(flags, changed):
    params = generate_params(*flags)
    assert params == {**DEFAULT_PARAMS, **changed}
    SamplingParams(**params)


def test_generate_defaults_are_the_buses():
    wire = SamplingParams(**DEFAULT_PARAMS)
    assert (wire.n, wire.best_of, wire.beam_width, wire.length_penalty, wire.early_stopping, wire.presence_penalty,
            wire.frequency_penalty, wire.repetition_penalty, wire.min_tokens, wire.logit_bias, wire.prompt_logprobs) \
        == (1, None, 1, 1.0, False, 0.0, 0.0, 1.0, 0, [], None)


def completion_of(outputs, logprobs: bool = False, prompt_logprobs=None):
    from tandem.client import Completion

    best = outputs[0]
    return Completion(best.text, best.token_ids, [104, 105], best.finish_reason, 0.01, 0.002, "req-1",
                      "decode-a", None, [], best.logprobs, best.cumulative_logprob, outputs, prompt_logprobs)


def test_generate_json_is_one_object_with_every_output_best_first():
    from tandem.cli.main import completion_json
    from tandem.client import CompletionOutput
    from tandem.shared.protocol.serving import TokenLogprobs

    first = [TokenLogprobs(logprob=-0.5, top=[(65, -0.5), (66, -1.5)])]
    outputs = [CompletionOutput("A", [65], "length", -0.5, first, 1),
               CompletionOutput("B", [66], "stop", -2.0, [TokenLogprobs(logprob=-2.0)], 0)]
    prompt = [None, TokenLogprobs(logprob=-3.0, top=[(9, -1.0)])]
    shown = completion_json(completion_of(outputs, prompt_logprobs=prompt))
    assert shown["prompt_token_ids"] == [104, 105]
    assert shown["outputs"] == [
        {"text": "A", "token_ids": [65], "finish_reason": "length", "cumulative_logprob": -0.5,
         "logprobs": [{"logprob": -0.5, "top": [[65, -0.5], [66, -1.5]]}]},
        {"text": "B", "token_ids": [66], "finish_reason": "stop", "cumulative_logprob": -2.0,
         "logprobs": [{"logprob": -2.0, "top": []}]}]
    assert shown["prompt_logprobs"] == [None, {"logprob": -3.0, "top": [[9, -1.0]]}]
    # Beside them, the best output's fields as one-output requests have always printed them.
    assert (shown["text"], shown["token_ids"], shown["finish_reason"], shown["ttft_s"], shown["tpot_s"]) == \
        ("A", [65], "length", 0.01, 0.002)
    assert shown["logprobs"] == [{"token_id": 65, "logprob": -0.5, "top_logprobs": [
        {"token_id": 65, "logprob": -0.5}, {"token_id": 66, "logprob": -1.5}]}]
    json.dumps(shown)


def test_generate_json_without_logprobs_says_null():
    from tandem.cli.main import completion_json
    from tandem.client import CompletionOutput

    shown = completion_json(completion_of([CompletionOutput("A", [65], "length", None, None)]))
    assert shown["outputs"] == [{"text": "A", "token_ids": [65], "finish_reason": "length",
                                 "cumulative_logprob": None, "logprobs": None}]
    assert "prompt_logprobs" not in shown and "logprobs" not in shown


def test_several_outputs_in_plain_text_are_labelled():
    from tandem.cli.main import labelled_outputs
    from tandem.client import CompletionOutput

    text = labelled_outputs(completion_of([CompletionOutput("one\ntwo", [1], "stop", -1.25, None),
                                           CompletionOutput("three", [2], "length", None, None, 1)]))
    assert text == ("--- output 1 of 2 (stop, cumulative logprob -1.250)\none\ntwo\n"
                    "--- output 2 of 2 (length)\nthree\n")


def test_generate_bounds_come_from_sampling_params():
    """The message is read off the field, so a changed bound changes the message with it."""
    for field, flag in (("top_p", "--top-p"), ("temperature", "--temperature"), ("top_k", "--top-k")):
        with pytest.raises(ValidationError) as exc:
            SamplingParams(**{field: -1e9})
        assert invalid_value(exc.value, SamplingParams, {field: flag}) == \
            f"{flag} must be {field_bounds(SamplingParams.model_fields[field])}"


class Bounded(BaseModel):
    both_open: float = Field(0.5, gt=0, lt=1)
    both_closed: int = Field(1, ge=1, le=8)
    lower: int = Field(1, ge=1)
    strictly_lower: float = Field(1.0, gt=0.25)
    upper: int = Field(0, le=10)
    free: int = 0
    name: str = Field("x", min_length=1)


@pytest.mark.parametrize(("field", "bounds"), [
    ("both_open", "in (0, 1)"), ("both_closed", "in [1, 8]"), ("lower", ">= 1"), ("strictly_lower", "> 0.25"),
    ("upper", "<= 10"), ("free", None),
])
def test_field_bounds(field, bounds):
    assert field_bounds(Bounded.model_fields[field]) == bounds


def test_a_field_without_bounds_keeps_pydantics_words():
    with pytest.raises(ValidationError) as exc:
        Bounded(name="")
    assert invalid_value(exc.value, Bounded, {"name": "--name"}) == "--name must have at least 1 character"


@pytest.mark.parametrize(("flags", "message"), [
    (["--num-prompts", "0"], "--num-prompts must be >= 1"),
    (["--output-len", "0"], "--output-len must be >= 1"),
    (["--input-len", "-3"], "--input-len must be >= 1"),
    (["--request-rate", "-1"], "--request-rate must be > 0"),
    (["--request-rate", "0"], "--request-rate must be > 0"),
    (["--burstiness", "0"], "--burstiness must be > 0"),
    (["--max-concurrency", "0"], "--max-concurrency must be >= 1"),
    (["--num-warmups", "-1"], "--num-warmups must be >= 0"),
    (["--range-ratio", "1"], "--range-ratio must be in [0, 1)"),
    (["--prefix-ratio", "1.5"], "--prefix-ratio must be in [0, 1]"),
    (["--num-prefixes", "0"], "--num-prefixes must be >= 1"),
    (["--timeout", "0"], "--timeout must be > 0"),
    (["--vocab-size", "0"], "--vocab-size must be >= 1"),
    (["--goodput", "ttft:-5"], "--goodput takes ttft:MS, tpot:MS or e2el:MS with MS > 0, not 'ttft:-5'"),
    (["--goodput", "ttft:soon"], "--goodput takes ttft:MS, tpot:MS or e2el:MS with MS > 0, not 'ttft:soon'"),
    (["--base-url", "localhost:8000"], "--base-url must start with http:// or https://, not 'localhost:8000'"),
])
def test_bench_serve_refuses_nonsense(flags, message, capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("TANDEM_DATA_DIR", str(tmp_path))  # no running tandem to find, should a check slip
    monkeypatch.delenv("TANDEM_NATS_URL", raising=False)
    code, out, err = run_main(["bench", "serve", *flags], capsys)
    assert (code, out, err) == (2, "", f"tandem bench serve: {message}\n")


def test_prompt_from_stdin_is_read_as_is():
    assert read_prompt("-", io.StringIO("def f(x):\n    return")) == "def f(x):\n    return"


def test_prompt_from_a_file_is_read_as_is(tmp_path):
    path = tmp_path / "prompt.txt"
    path.write_text("import os\n", encoding="utf-8")
    assert read_prompt(f"@{path}") == "import os\n"
    assert read_prompt("plain text") == "plain text"


@pytest.mark.parametrize(("arg", "stdin", "says"), [
    ("@{dir}/missing.txt", "", "cannot read the prompt file {dir}/missing.txt: No such file or directory"),
    ("@{dir}", "", "cannot read the prompt file {dir}: Is a directory"),
    ("@{dir}/latin1.txt", "", "the prompt file {dir}/latin1.txt is not UTF-8 text"),
    ("@{dir}/empty.txt", "", "the prompt from the prompt file {dir}/empty.txt is empty"),
    ("-", "", "the prompt from standard input is empty"),
    ("", "", "the prompt from the command line is empty"),
])
def test_unreadable_prompts_are_one_line(arg, stdin, says, tmp_path):
    (tmp_path / "latin1.txt").write_bytes("café".encode("latin-1"))
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(UsageError) as exc:
        read_prompt(arg.format(dir=tmp_path), io.StringIO(stdin))
    assert str(exc.value) == says.format(dir=tmp_path)


def test_a_missing_prompt_file_exits_2_naming_it(capsys, tmp_path):
    code, _, err = run_main(["generate", f"@{tmp_path}/nope.txt"], capsys)
    assert (code, err) == (2, f"tandem generate: cannot read the prompt file {tmp_path}/nope.txt: "
                              "No such file or directory\n")


INFOS = [  # $SRV.INFO answers as nats micro sends them (tandem's metadata values are strings)
    {"name": "tandem-router", "id": "r1", "version": "0.1.0",
     "metadata": {"instance_id": "router-a", "host": "h1", "pid": "11", "metrics_url": "http://h1:9/metrics"}},
    {"name": "tandem-decode", "id": "d1", "version": "0.1.0",
     "metadata": {"instance_id": "decode-b", "host": "h2", "pid": "22", "metrics_url": ""}},
    {"name": "tandem-decode", "id": "d0", "version": "0.1.0",
     "metadata": {"instance_id": "decode-a", "host": "h2", "pid": "21", "metrics_url": "http://h2:8/metrics"}},
]


def test_service_rows_are_sorted_and_typed():
    rows = service_rows(INFOS)
    assert [(r["service"], r["instance"]) for r in rows] == [
        ("tandem-decode", "decode-a"), ("tandem-decode", "decode-b"), ("tandem-router", "router-a")]
    assert rows[0]["pid"] == 21 and rows[1]["metrics_url"] is None and rows[2]["http_url"] is None
    assert rows[2]["metadata"]["host"] == "h1", "the whole metadata stays in the machine output"


def test_the_http_column_appears_with_a_frontend():
    plain = services_table(service_rows(INFOS)).splitlines()
    assert plain[0].split() == ["SERVICE", "INSTANCE", "VERSION", "HOST", "PID", "METRICS"]
    assert plain[2].split() == ["tandem-decode", "decode-b", "0.1.0", "h2", "22", "-"], "a missing URL shows as -"
    frontend = {"name": "tandem-frontend", "id": "f1", "version": "0.1.0",
                "metadata": {"instance_id": "frontend-a", "host": "h3", "pid": "33", "metrics_url": "http://h3:7/m",
                             "http_url": "http://h3:8000"}}
    table = services_table(service_rows([*INFOS, frontend])).splitlines()
    assert table[0].split()[-1] == "HTTP"
    (row,) = [line.split() for line in table if line.startswith("tandem-frontend")]
    assert row[-1] == "http://h3:8000" and table[1].split()[-1] == "-", "only the frontend serves HTTP"
    columns = [line.index("0.1.0") for line in table[1:]]
    assert len(set(columns)) == 1, f"columns are aligned:\n{chr(10).join(table)}"
