"""The public API is a contract: its exports are pinned here."""

from durable_agents import api

PUBLIC_API = [
    "DefinitionError",
    "DurableAgentsError",
    "EffectOutcomeUnknownError",
    "Field",
    "FunctionParticipant",
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
    "ScriptedParticipant",
    "StepContext",
    "StepNotFoundError",
    "StepStatus",
    "Tool",
    "ToolArgumentsError",
    "UnknownToolError",
    "UnknownWorkflowError",
    "Workflow",
    "agent",
    "call",
    "cancel",
    "get",
    "participants",
    "registry",
    "resume",
    "set_budget",
    "start",
    "swap_participant",
    "tool",
    "tool_step",
    "workflow",
]


def test_api__exports_are_pinned():
    assert sorted(api.__all__) == sorted(PUBLIC_API), (
        "the public API changed: update PUBLIC_API on purpose, and the README"
    )
    for name in api.__all__:
        assert hasattr(api, name), f"api.__all__ names {name} but the module has no such attribute"
