"""Load the package's own pytest plugin when it runs from a source tree (not installed)."""


def pytest_configure(config):
    if not config.pluginmanager.has_plugin("ms_layout"):
        import ms_layout.testing

        config.pluginmanager.register(ms_layout.testing, "ms_layout")
