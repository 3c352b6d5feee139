import pytest
import torch


@pytest.fixture(autouse=True)
def _seed_and_one_thread():
    """Tiny models run fastest on one thread, and the CI/dev CPUs are shared."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    yield
    torch.set_num_threads(threads)
