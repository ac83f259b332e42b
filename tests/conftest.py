import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Let the tests import the in-tree packages (models/, tests/) without installing them.
sys.path.insert(0, str(ROOT))

FIXTURES = ROOT / "models" / "fixtures"


def fixture_models() -> list[Path]:
    return sorted(FIXTURES.glob("*.onnx"))


@pytest.fixture
def fixtures_dir() -> Path:
    return FIXTURES
