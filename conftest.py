"""nbval settings, and which tests `make check` leaves out.

- plotly's JSON output embeds its whole template, which changes across plotly releases, so
  compare the text outputs of lesson cells and skip plotly's mime types.
- A lesson that times the engine (or a server) runs beside three busy loops
  (`tests/busy.py`), more than this 2-core machine has cores, so every checked cell must
  print the same on a loaded machine. Set LABKIT_IDLE_LESSONS=1 to run them on an idle
  machine instead, when debugging a lesson.
- The tests that start servers, browsers or other processes, or load transformers (an oracle
  or a tokenizer: seconds to import), are marked `integration`: whole modules here, single
  tests where they are defined. `make check` runs the unit and property tests without them
  (and without the lessons), and does not even import the modules named here; `make test`
  runs everything.
"""

import os
import sys

import pytest

from tests.busy import start_busy_loops, stop, times_the_engine

BUSY_LOOPS = pytest.StashKey()
INTEGRATION = {  # test modules that start servers, browsers or other processes, or load transformers
    "test_browser.py", "test_busy_core.py", "test_bench_peers.py", "test_checkpoint.py", "test_hf_oracle.py",
    "test_html_export.py", "test_make_student.py", "test_peers_module.py", "test_replay_transformers_serve.py",
    "test_engine_process.py", "test_guidellm.py", "test_serve.py", "test_serve_checkpoint.py", "test_serve_hardening.py", "test_vllm.py",
}
LEAVE_OUT_INTEGRATION = "not integration"  # `make check`'s -m


def pytest_collectstart(collector):
    if collector.fspath and collector.fspath.ext == ".ipynb":
        collector.skip_compare += ("application/vnd.plotly.v1+json", "text/html")


def pytest_ignore_collect(collection_path, config):
    """Under `-m "not integration"`, skip the integration modules before they are imported."""
    if config.getoption("markexpr") == LEAVE_OUT_INTEGRATION and collection_path.name in INTEGRATION:
        return True
    return None


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.name in INTEGRATION:
            item.add_marker(pytest.mark.integration)


def pytest_collection_finish(session):
    """One torch thread for the tests' own tensors, which are tiny: a second thread only spins, and
    on a 2-core machine shared with other work it made a property test of attention 6 times slower.
    An `Engine` sets its own thread count while it runs, as it does everywhere."""
    torch = sys.modules.get("torch")  # imported by the test modules that use it, never here
    if torch is not None:
        torch.set_num_threads(1)


def pytest_runtest_setup(item):
    """Keep the cores busy while a timed lesson's cells run under strict nbval, and only then."""
    path = item.path
    wanted = (path.suffix == ".ipynb" and path.parent.name == "solutions" and times_the_engine(path)
              and not os.environ.get("LABKIT_IDLE_LESSONS"))
    running = item.config.stash.get(BUSY_LOOPS, None)
    if wanted and running is None:
        item.config.stash[BUSY_LOOPS] = start_busy_loops()
    elif not wanted and running is not None:
        _stop(item.config)


def pytest_unconfigure(config):
    if config.stash.get(BUSY_LOOPS, None) is not None:
        _stop(config)


def _stop(config):
    stop(config.stash[BUSY_LOOPS])
    config.stash[BUSY_LOOPS] = None
