"""The public API is a contract: its exports are pinned here."""

from durable_agents import api


def test_api__exports_are_pinned():
    assert sorted(api.__all__) == sorted(
        [
            "DefinitionError",
            "DurableAgentsError",
            "IdempotencyKeyReusedError",
            "InputTooLargeError",
            "InvalidInputError",
            "InvalidTransitionError",
            "LeaseLostError",
            "PermanentError",
            "PlannedStep",
            "RetryPolicy",
            "RetryableError",
            "Run",
            "RunNotFoundError",
            "RunStatus",
            "StepContext",
            "StepNotFoundError",
            "StepStatus",
            "UnknownWorkflowError",
            "Workflow",
            "call",
            "cancel",
            "get",
            "registry",
            "resume",
            "start",
            "workflow",
        ]
    ), "the public API changed: update this list on purpose, and the README"
    for name in api.__all__:
        assert hasattr(api, name), f"api.__all__ names {name} but the module has no such attribute"
