from tests.model.conftest import tiny_models  # noqa: F401  (session fixture)
