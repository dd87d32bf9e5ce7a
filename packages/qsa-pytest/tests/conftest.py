"""The plugin's own tests drive it in a child pytest through ``pytester``, and use it."""

pytest_plugins = ("pytester", "qsa_pytest.gpu")
