"""Load ms-layout's pytest plugin (markers, run_ranks) when running from a source tree, and keep the
modules that import MindSpore at the top out of the core run (``-m "not needs_mindspore"``), which
has no MindSpore installed. Elsewhere they are collected as usual, so a broken install fails loudly
instead of skipping."""

MINDSPORE_MODULES = {"test_recompute_grads.py", "test_memory_measured.py"}


def pytest_configure(config):
    if not config.pluginmanager.has_plugin("ms_layout"):
        import ms_layout.testing

        config.pluginmanager.register(ms_layout.testing, "ms_layout")


def pytest_ignore_collect(collection_path, config):
    if collection_path.name in MINDSPORE_MODULES and "not needs_mindspore" in (config.getoption("markexpr") or ""):
        return True
    return None
