"""requirements=: each host makes a virtual environment with them, once,
layered on its own Python; the workers run in it."""

from __future__ import annotations

import pytest

import remote_tpu
from remote_tpu._core.exceptions import ConfigurationError

from package_index import make_wheel

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


@pytest.fixture(scope="module")
def wheels(tmp_path_factory):
    directory = tmp_path_factory.mktemp("wheels")
    make_wheel(str(directory), "rtpu_test_tiny")
    return str(directory)


def _on(agents, **kw):
    return remote_tpu.run(accelerator="tpu-v4-16", hosts=agents.addresses[0],
                          token=agents.token, init_jax=False, stream="all", **kw)


def _uses_it(report):
    import os
    import sys

    import rtpu_test_tiny
    with open(os.path.join(report, os.environ["JAX_PROCESS_ID"]), "w") as f:
        f.write(sys.executable)
    return rtpu_test_tiny.ANSWER


def test_a_requirement_is_installed_once_per_host_and_used(agents, wheels, tmp_path, capfd):
    with pytest.raises(ImportError):
        import rtpu_test_tiny  # noqa: F401 - not here: only on the hosts
    reqs = ["--no-index", f"--find-links {wheels}", "rtpu-test-tiny==1.0"]
    fn = _on(agents, requirements=reqs)(_uses_it)
    assert fn(str(tmp_path)) == 42
    err = capfd.readouterr().err
    assert "[host 0] Successfully installed rtpu-test-tiny-1.0" in err
    assert "[host 1] Successfully installed rtpu-test-tiny-1.0" in err
    pythons = [open(tmp_path / h).read() for h in ("0", "1")]
    assert all("/envs/" in p for p in pythons)
    assert fn(str(tmp_path)) == 42
    assert "Successfully installed" not in capfd.readouterr().err     # made once per host
    req_file = tmp_path / "requirements.txt"
    req_file.write_text("# the same, from a file\n" + "\n".join(reqs) + "\n")
    assert _on(agents, requirements=str(req_file))(_uses_it)(str(tmp_path)) == 42
    assert "Successfully installed" not in capfd.readouterr().err     # the same environment


def test_the_hosts_own_jax_stays_unless_allowed(agents):
    with pytest.raises(ConfigurationError, match="would replace the host's own jax"):
        _on(agents, requirements=["jax==0.4.1"])
    with pytest.raises(ConfigurationError, match="would replace"):
        _on(agents, requirements=["libtpu-nightly", "cloudpickle>=1"])

    def version():
        import jax
        return jax.__version__

    # (not `import jax` here: it sets TPU_SKIP_MDS_QUERY in this process's environment,
    # which later agents started by the tests would inherit)
    import importlib.metadata
    allowed = _on(agents, requirements=["--no-index", "jax"], allow_jax_requirements=True)
    assert allowed(version)() == importlib.metadata.version("jax")   # the host's own


def test_a_failing_install_fails_the_job_naming_the_host_and_the_error(agents, wheels):
    fn = _on(agents, requirements=["--no-index", f"--find-links {wheels}",
                                   "rtpu-no-such-package==9"])(lambda: 1)
    with pytest.raises(remote_tpu.JobFailedError) as err:
        fn()
    text = str(err.value)
    assert "could not prepare the job" in text and "installing the requirements failed" in text
    assert "rtpu-no-such-package" in text
    with pytest.raises(ConfigurationError, match="cannot read"):
        _on(agents, requirements="/no/such/requirements.txt")


def test_a_dependency_cannot_replace_the_hosts_cloudpickle(agents, tmp_path):
    """Only the requirement lines are screened for jax, libtpu, cloudpickle...;
    a dependency that pins one of them is held to the host's version too."""
    make_wheel(str(tmp_path), "cloudpickle", "3.0.0", body="__version__ = 'replaced'\n")
    make_wheel(str(tmp_path), "rtpu_test_pins", requires=["cloudpickle==3.0.0"])

    def cloudpickle_version():
        import cloudpickle
        return cloudpickle.__version__

    fn = _on(agents, requirements=["--no-index", f"--find-links {tmp_path}",
                                   "rtpu-test-pins"])(cloudpickle_version)
    with pytest.raises(remote_tpu.JobFailedError) as err:
        fn()
    text = str(err.value)
    assert "installing the requirements failed" in text
    assert "cloudpickle==3.0.0" in text            # the installer's own words
    assert "held at this host's versions" in text and "allow_jax_requirements" in text
