"""The public API is a contract: its exports are pinned here."""

from durable_agents import api

PUBLIC_API = [
    "DefinitionError",
    "ApprovalRejectedError",
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
    "ToolFailedError",
    "UnknownToolError",
    "UnknownWorkflowError",
    "WaitClosedError",
    "WaitNotFoundError",
    "Workflow",
    "agent",
    "approval",
    "call",
    "cancel",
    "decide",
    "fork",
    "get",
    "judge",
    "migrate",
    "participants",
    "planner",
    "registry",
    "resolve_effect",
    "resume",
    "send_signal",
    "set_budget",
    "sleep",
    "start",
    "swap_participant",
    "tool",
    "tool_step",
    "wait_for_signal",
    "workflow",
]


def test_api__exports_are_pinned():
    assert sorted(api.__all__) == sorted(PUBLIC_API), (
        "the public API changed: update PUBLIC_API on purpose, and the README"
    )
    for name in api.__all__:
        assert hasattr(api, name), f"api.__all__ names {name} but the module has no such attribute"
