"""Fixtures the Flower mod tests share (each test file skips itself where Flower is not installed)."""
from __future__ import annotations

import pytest

import leakbench as lb


@pytest.fixture
def task_identity():
    """Flower's task identity set as a running client has it (mods read it), restored afterwards."""
    from flwr.supercore.task_identity import TaskIdentity

    saved = (TaskIdentity._run_id, TaskIdentity._task_id, TaskIdentity._node_id)
    TaskIdentity.run_id, TaskIdentity.task_id, TaskIdentity.node_id = 1, 1, 0
    yield
    TaskIdentity._run_id, TaskIdentity._task_id, TaskIdentity._node_id = saved


@pytest.fixture(scope="module")
def batch():
    """One digit and its label: the client's whole partition."""
    data = lb.load("digits")
    return data.images[:1].clone(), data.labels[:1].clone()
