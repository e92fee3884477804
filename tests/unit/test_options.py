"""The decorator validates everything when applied, before anything runs."""

import pytest

import remote_tpu
from remote_tpu import ConfigurationError


def test_bare_decorator_says_to_add_parentheses():
    with pytest.raises(ConfigurationError, match=r"with parentheses"):
        @remote_tpu.run
        def f():
            pass


def test_missing_accelerator_says_what_to_pass(monkeypatch):
    monkeypatch.delenv("REMOTE_TPU_ACCELERATOR", raising=False)
    with pytest.raises(ConfigurationError, match="needs accelerator="):
        remote_tpu.run(hosts="local")


def test_bad_accelerator_fails_when_applied():
    with pytest.raises(ConfigurationError, match="Nearest valid: tpu-v5p-24 or tpu-v5p-32"):
        remote_tpu.run(accelerator="tpu-v5p-30", hosts="local")


def test_wrapper_keeps_name_doc_and_runs_locally():
    @remote_tpu.run(accelerator="tpu-v4-16", hosts="local")
    def add(a, b=2):
        """Adds."""
        return a + b

    assert add.__name__ == "add" and add.__doc__ == "Adds."
    assert add.local(1, b=5) == 6
    assert "tpu-v4-16" in repr(add)


@pytest.mark.parametrize("kwargs, message", [
    ({"stream": "some"}, "stream='some' is not one of leader, all, none"),
    ({"timeout": -1}, "timeout must be a positive, finite number"),
    ({"timeout": "10"}, "timeout must be a positive, finite number"),
    ({"timeout": float("nan")}, "timeout must be a positive, finite number"),
    ({"timeout": float("inf")}, "timeout must be a positive, finite number"),
    ({"env": {"A": 1}}, "must be a string"),
    ({"env": {"1A": "x"}}, "not a valid variable name"),
    ({"env": ["A=1"]}, "must be a mapping"),
    ({"hosts": "10.0.0.1:99999"}, "port 99999 is not in 1-65535"),
    ({"hosts": "not an address!"}, "not of the form 'ip[:port]'"),
    ({"hosts": []}, "non-empty list"),
    ({"hosts": ["10.0.0.1", "10.0.0.1"]}, "lists an address twice"),
    ({"jax_timeouts": remote_tpu.JaxTimeouts(heartbeat=0)}, "jax_timeouts.heartbeat"),
])
def test_bad_options_are_named(kwargs, message):
    with pytest.raises(ConfigurationError) as info:
        remote_tpu.run(accelerator="tpu-v4-16", **kwargs)
    assert message in str(info.value)


def test_host_count_mismatch_names_both_numbers():
    with pytest.raises(ConfigurationError) as info:
        remote_tpu.run(accelerator="tpu-v5p-32", hosts=["10.0.0.1", "10.0.0.2"])
    msg = str(info.value)
    assert "tpu-v5p-32 has 4 host(s)" in msg and "lists 2" in msg


def test_addresses_get_the_default_port():
    f = remote_tpu.run(accelerator="tpu-v4-16", hosts=["10.0.0.1", "[::1]:9000"])(len)
    assert f.options.hosts.entries == ("10.0.0.1:8475", "[::1]:9000")
    g = remote_tpu.run(accelerator="tpu-v5p-32", hosts="10.0.0.2")(len)
    assert g.options.hosts.entries == ("10.0.0.2:8475",)
    # One string, comma-separated, as `remote-tpu local` prints REMOTE_TPU_HOSTS:
    h = remote_tpu.run(accelerator="tpu-v4-16", hosts="10.0.0.1, [::1]:9000,")(len)
    assert h.options.hosts.entries == ("10.0.0.1:8475", "[::1]:9000")
    for odd in ("local,10.0.0.1", ["10.0.0.1", "tpu://v4?zone=z"], "tpu://v4?zone=z,10.0.0.1"):
        with pytest.raises(ConfigurationError, match="among other hosts: give it alone"):
            remote_tpu.run(accelerator="tpu-v4-16", hosts=odd)
    for alone in (["local"], " LOCAL,", ["tpu://v4?zone=z"], " tpu://v4?zone=z"):
        assert remote_tpu.run(accelerator="tpu-v4-16", hosts=alone)(len).options.hosts.entries \
            in {("local",), ("tpu://v4?zone=z",)}
    with pytest.raises(ConfigurationError, match="got b'10.0.0.1'"):
        remote_tpu.run(accelerator="tpu-v4-16", hosts=b"10.0.0.1")


def test_environment_is_the_fallback_and_arguments_win(monkeypatch):
    monkeypatch.setenv("REMOTE_TPU_HOSTS", "10.0.0.1,10.0.0.2")
    monkeypatch.setenv("REMOTE_TPU_STREAM", "all")
    monkeypatch.setenv("REMOTE_TPU_TIMEOUT", "30")
    f = remote_tpu.run(accelerator="tpu-v4-16")(len)
    assert f.options.hosts.entries == ("10.0.0.1:8475", "10.0.0.2:8475")
    assert (f.options.stream, f.options.timeout) == ("all", 30.0)
    g = remote_tpu.run(accelerator="tpu-v4-16", hosts="local", stream="none", timeout=5)(len)
    assert (g.options.hosts.entries, g.options.stream, g.options.timeout) == \
        (("local",), "none", 5.0)
    monkeypatch.setenv("REMOTE_TPU_HOSTS", "10.0.0.1,10.0.0.2,10.0.0.3")
    with pytest.raises(ConfigurationError, match="REMOTE_TPU_HOSTS lists 3"):
        remote_tpu.run(accelerator="tpu-v4-16")
    monkeypatch.setenv("REMOTE_TPU_TIMEOUT", "soon")
    with pytest.raises(ConfigurationError, match="REMOTE_TPU_TIMEOUT='soon'"):
        remote_tpu.run(accelerator="tpu-v4-8", hosts="local")


def test_default_hosts_is_the_local_slice(monkeypatch):
    monkeypatch.delenv("REMOTE_TPU_HOSTS", raising=False)
    assert remote_tpu.run(accelerator="tpu-v4-16")(len).options.local


def test_every_remote_tpu_variable_the_code_names_is_known():
    import pathlib
    import re

    from remote_tpu._options import KNOWN_VARIABLES

    root = pathlib.Path(__file__).resolve().parents[2]
    named = set()
    for path in [*root.glob("remote_tpu/**/*.py"), *root.glob("agent/**/*.py")]:
        named |= set(re.findall(r"REMOTE_TPU_[A-Z0-9_]*[A-Z0-9]", path.read_text()))
    named -= {"REMOTE_TPU_TLS", "REMOTE_TPU_FIELD_NUMBER"}    # a prefix; a proto constant
    assert named <= KNOWN_VARIABLES, f"add to KNOWN_VARIABLES: {sorted(named - KNOWN_VARIABLES)}"


def test_a_misspelt_variable_warns_once_with_the_nearest_name(monkeypatch):
    from remote_tpu import _options

    monkeypatch.setattr(_options, "_warned_variables", set())
    monkeypatch.setenv("REMOTE_TPU_KEEPWARM", "60")
    monkeypatch.setenv("REMOTE_TPU_NOT_A_THING_AT_ALL", "1")
    with pytest.warns(UserWarning) as caught:
        remote_tpu.run(accelerator="tpu-v4-8")(print)
    said = [str(w.message) for w in caught]
    assert any("REMOTE_TPU_KEEPWARM" in m and "did you mean REMOTE_TPU_KEEP_WARM?" in m
               for m in said), said
    assert any("REMOTE_TPU_NOT_A_THING_AT_ALL" in m and "docs/options.md" in m
               for m in said), said
    assert {w.filename for w in caught} == {__file__}      # the user's line, not ours
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")                 # once: not again
        remote_tpu.run(accelerator="tpu-v4-8")(print)


BAD_VARIABLES = [
    ("REMOTE_TPU_STREAM", "everything", "is not one of leader, all, none"),
    ("REMOTE_TPU_TIMEOUT", "-3", "positive, finite number of seconds"),
    ("REMOTE_TPU_TIMEOUT", "soon", "not a number of seconds"),
    ("REMOTE_TPU_ACCELERATOR", "tpu-v4-9", "Nearest valid: tpu-v4-8 or tpu-v4-16"),
    ("REMOTE_TPU_WORKING_DIR", "/no/such/dir", "is not a directory"),
    ("REMOTE_TPU_KEEP_WARM", "99999999", "from 0 (off) to 604800"),
    ("REMOTE_TPU_HOSTS", "not an address!", "is not of the form 'ip[:port]'"),
    ("REMOTE_TPU_OUTPUT_DIR", "ftp://x/y", "only gs:// URIs and local directories"),
    ("REMOTE_TPU_STAGING", "/tmp", "give a gs://bucket/prefix"),
    ("REMOTE_TPU_RETRIES", "many", "not a whole number"),
    ("REMOTE_TPU_NUM_SLICES", "0", "from 1 to 64"),
    ("REMOTE_TPU_ALL_RESULTS", "maybe", "is not true or false: use 1 or 0"),
    ("REMOTE_TPU_COMPILATION_CACHE", "cache", "compilation_cache= must be a gs://bucket"),
    ("REMOTE_TPU_STALL_AFTER", "soon", "give a number of seconds, or off"),
    ("REMOTE_TPU_ON_STALL", "panic", "is not one of 'report', 'cancel'"),
]


def test_every_options_variable_has_a_bad_value_case():
    from remote_tpu._options import OPTIONS

    assert {o.env for o in OPTIONS if o.env} == {name for name, _, _ in BAD_VARIABLES}


@pytest.mark.parametrize("name, value, said", BAD_VARIABLES)
def test_a_bad_value_from_a_variable_names_the_variable(monkeypatch, name, value, said):
    monkeypatch.setenv(name, value)
    with pytest.raises(ConfigurationError) as info:
        remote_tpu.run(accelerator=None if name == "REMOTE_TPU_ACCELERATOR" else "tpu-v4-8")(print)
    message = str(info.value)
    assert message.startswith(f"{name}={value!r} (from the environment)"), message
    assert said in message and f"unset {name}" in message, message


# ---------------------------------------------------------------- the one table

def test_runs_signature_is_the_tables():
    import inspect

    from remote_tpu._options import OPTIONS

    params = list(inspect.signature(remote_tpu.run).parameters.values())[1:]   # after fn
    assert [(p.name, p.default, p.annotation, p.kind) for p in params] == \
        [(o.name, o.default, o.type, inspect.Parameter.KEYWORD_ONLY) for o in OPTIONS]


def test_runs_docstring_has_one_entry_per_option_naming_its_variable():
    from remote_tpu._options import OPTIONS
    from remote_tpu._options_doc import docstring_entries

    entries = docstring_entries(remote_tpu.run.__doc__)
    assert list(entries) == [o.name for o in OPTIONS]
    for o in OPTIONS:
        if o.env:
            assert o.env in entries[o.name], f"{o.name}'s entry does not name {o.env}"


def test_run_options_has_the_tables_fields():
    import dataclasses

    from remote_tpu._options import NOT_OPTIONS, OPTIONS, RunOptions

    fields = [f.name for f in dataclasses.fields(RunOptions)]
    assert sorted(fields) == sorted([t for o in OPTIONS for t in o.targets] + list(NOT_OPTIONS))


def test_the_tables_job_spec_fields_are_the_spec_s_and_filled_as_declared():
    from remote_tpu._core.proto import remote_tpu_pb2 as pb
    from remote_tpu._options import OPTIONS, spec_fields

    known = set(pb.JobSpec.DESCRIPTOR.fields_by_name)
    for o in OPTIONS:
        if o.spec is not None:
            assert set(o.spec.fields) <= known, (o.name, o.spec.fields)
            assert bool(o.spec.by) != bool(o.spec.fill), o.name   # one or the other
    options = remote_tpu.run(accelerator="tpu-v4-16", num_slices=2, output_dir="gs://b-1/p",
                             init_jax=False, env={"A": "1"}, timeout=3)(len).options
    filled = spec_fields(options)
    assert set(filled) == {f for o in OPTIONS if o.spec and o.spec.fill for f in o.spec.fields}
    spec = pb.JobSpec(**filled)
    assert (spec.accelerator, spec.num_hosts, spec.num_slices, spec.skip_jax_init,
            spec.timeout_seconds, dict(spec.env), spec.output_dir, spec.collect_outputs) == \
        ("tpu-v4-16", 4, 2, True, 3.0, {"A": "1"}, "gs://b-1/p", False)


def test_a_job_name_is_checked_and_starts_the_job_ids():
    f = remote_tpu.run(accelerator="tpu-v4-8", name="nightly.eval_2")(len)
    assert f.options.name == "nightly.eval_2" and f._name == "nightly.eval_2"
    assert remote_tpu.run(accelerator="tpu-v4-8")(len)._name == "len"
    for bad, said in (("my run", "e.g. 'my-run'"), ("", "a job name is 1 to 40"),
                      ("x" * 41, "1 to 40"), (3, "a job name")):
        with pytest.raises(ConfigurationError, match=said):
            remote_tpu.run(accelerator="tpu-v4-8", name=bad)


def test_an_option_that_asks_for_another_does_not_claim_its_error(monkeypatch):
    # hosts= asks for num_slices; the bad variable is num_slices', not hosts'.
    monkeypatch.setenv("REMOTE_TPU_HOSTS", "10.0.0.1")
    monkeypatch.setenv("REMOTE_TPU_NUM_SLICES", "two")
    with pytest.raises(ConfigurationError) as info:
        remote_tpu.run(accelerator="tpu-v4-8")
    assert str(info.value).startswith("REMOTE_TPU_NUM_SLICES='two' (from the environment)")


def test_the_options_page_is_what_the_table_makes():
    import pathlib

    from remote_tpu._options_doc import HEADER, generate

    page = pathlib.Path(__file__).resolve().parents[2] / "docs" / "options.md"
    text = page.read_text(encoding="utf-8")
    assert text.splitlines()[0] == HEADER
    assert text == generate(), ("docs/options.md is stale: regenerate it with "
                                "`python -m remote_tpu._options_doc`")


def test_the_page_generator_writes_and_checks(tmp_path):
    from conftest import run_python

    page = tmp_path / "options.md"
    run = "from remote_tpu._options_doc import main; raise SystemExit(main({}))"
    assert run_python(run.format([f"--output={page}", "--check"])).returncode == 1  # missing
    assert run_python(run.format([f"--output={page}"])).returncode == 0
    assert run_python(run.format([f"--output={page}", "--check"])).returncode == 0
    page.write_text(page.read_text() + "edited by hand\n")
    stale = run_python(run.format([f"--output={page}", "--check"]))
    assert stale.returncode == 1 and "python -m remote_tpu._options_doc" in stale.stderr


def test_compilation_cache_names_what_it_takes(monkeypatch):
    on = lambda **kw: remote_tpu.run(accelerator="tpu-v4-8", **kw)(print).options  # noqa: E731
    assert on().compilation_cache == ""
    assert on(compilation_cache=False).compilation_cache == "off"
    assert on(compilation_cache="gs://b/jax-cache").compilation_cache == "gs://b/jax-cache"
    monkeypatch.setenv("REMOTE_TPU_COMPILATION_CACHE", "off")
    assert on().compilation_cache == "off"
    for bad in ("relative/dir", "gs://", 3, ""):
        with pytest.raises(remote_tpu.ConfigurationError, match="compilation_cache= must be"):
            on(compilation_cache=bad)


def test_stall_after_is_on_by_default_and_says_what_it_takes(monkeypatch):
    on = lambda **kw: remote_tpu.run(accelerator="tpu-v4-8", **kw)(print).options  # noqa: E731
    assert (on().stall_after, on().on_stall) == (300.0, "report")
    assert on(stall_after=False).stall_after == 0.0
    assert on(stall_after=0).stall_after == 0.0
    assert on(stall_after=2.5, on_stall="cancel").on_stall == "cancel"
    monkeypatch.setenv("REMOTE_TPU_STALL_AFTER", "off")
    assert on().stall_after == 0.0
    monkeypatch.setenv("REMOTE_TPU_STALL_AFTER", "60")
    assert on().stall_after == 60.0
    for bad in (-1, "5", 10 ** 9, float("nan")):
        with pytest.raises(remote_tpu.ConfigurationError, match="stall_after= must be"):
            on(stall_after=bad)
    with pytest.raises(remote_tpu.ConfigurationError, match="is not one of 'report', 'cancel'"):
        on(on_stall="kill")


def test_progress_outside_a_call_does_nothing_and_checks_its_step():
    remote_tpu.progress()
    remote_tpu.progress(step=3)
    for bad in (-1, 1.5, True, "7", 2 ** 63):
        with pytest.raises(remote_tpu.ConfigurationError, match="whole number >= 0"):
            remote_tpu.progress(step=bad)
