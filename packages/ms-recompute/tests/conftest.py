"""Load ms-layout's pytest plugin (markers, run_ranks) when running from a source tree."""


def pytest_configure(config):
    if not config.pluginmanager.has_plugin("ms_layout"):
        import ms_layout.testing

        config.pluginmanager.register(ms_layout.testing, "ms_layout")
