"""The exception tree of durable_agents; each docstring is the default message.

DurableAgentsError
 ├── DefinitionError              a workflow or step definition is invalid (raised at import)
 │    └── ToolDefinitionError     a tool definition is invalid (raised at decoration)
 ├── UnknownWorkflowError         no workflow (or version) by that name is registered
 ├── UnknownToolError             no tool by that name is registered
 ├── InvalidInputError            a run input is not acceptable
 │    ├── InputTooLargeError      the input is over the size limit
 │    └── ToolArgumentsError      tool arguments do not match the tool's schema (`errors` lists each)
 ├── IdempotencyKeyReusedError    a key was reused with a different input
 ├── RunNotFoundError             no run has that id
 ├── StepNotFoundError            the run has no step with that id
 ├── InvalidTransitionError       the run is not in a state that allows the operation
 │    ├── WaitClosedError         the wait was already decided, expired or cancelled
 │    └── BatchRefusedError       some runs of a batch cannot take the operation (`problems` lists each)
 ├── WaitNotFoundError            no wait has that id
 ├── ScheduleNotFoundError        no schedule has that name
 ├── ScheduleDeclaredError        the schedule is declared in code: change its declaration instead
 ├── CohortNotFoundError          no replay cohort has that name
 ├── ReplayNotFoundError          no replay has that id
 ├── ApprovalRejectedError        a human (or a deadline) rejected the action
 ├── ToolFailedError              a tool refused and changed nothing: the model is told
 ├── LeaseLostError               another worker holds the run now (this worker is a zombie)
 ├── UnknownParticipantError      no participant (model, script, function) by that name
 ├── NotificationFailedError      a notifier could not send (retried with backoff, then given up)
 │    └── DecisionLinkError       no decision link can be made (durable_agents.urls missing, a published key)
 ├── BrokerUnavailableError       the broker refused a wake-up (the run is kept; the sweep wakes it)
 └── StepError                    raised by step code to control retries
      ├── RetryableError          transient: retry with backoff
      │    ├── EffectConflictError          the same effect is being applied elsewhere
      │    └── ModelUnavailableError        connection, timeout, 429 (retry_after), 5xx, 529
      └── PermanentError          permanent: fail the step now
           ├── EffectOutcomeUnknownError    an external effect's outcome cannot be known
           ├── ModelRequestError            400/401/403/404/413 from the model API
           ├── ModelRefusalError            stop_reason "refusal"
           ├── ContextWindowExceededError   stop_reason "model_context_window_exceeded"
           ├── AgentLimitError              max_turns, or too many invalid tool calls
           ├── BudgetExceededError          the run's token or cost budget is spent
           ├── WaitExpiredError             a wait's deadline passed under the "fail" policy
           ├── ChildRunFailedError          a child run failed or was cancelled (fail-fast fan-out)
           ├── ReplayDivergedError          a replay made a tool call its recording never made
           ├── ReplayBudgetExceededError    a replay's token or cost budget is spent
           └── ReplayAppliesNothingError    a replay run reached an effect or a wait (refused)
"""

from __future__ import annotations

from collections.abc import Iterable


class DurableAgentsError(Exception):
    """Something went wrong in durable_agents."""

    def __init__(self, message: str | None = None) -> None:
        super().__init__(message or (self.__doc__ or "").strip())


class DefinitionError(DurableAgentsError):
    """The workflow or step definition is invalid."""


class UnknownWorkflowError(DurableAgentsError):
    """No workflow is registered under that name and version."""


class InvalidInputError(DurableAgentsError):
    """The run input is not acceptable."""


class InputTooLargeError(InvalidInputError):
    """The run input is larger than DURABLE_AGENTS['INPUT_MAX_BYTES']."""


class IdempotencyKeyReusedError(DurableAgentsError):
    """This idempotency key was already used with a different input; use a new key."""


class RunNotFoundError(DurableAgentsError):
    """No run has that id."""


class ScheduleNotFoundError(DurableAgentsError):
    """No schedule has that name; `durable_schedules` lists them."""


class ScheduleDeclaredError(DurableAgentsError):
    """The schedule is declared in code (DURABLE_AGENTS["SCHEDULES"] or a workflow's schedule=): change or remove
    its declaration there; each sweep brings its row back in step with the code."""


class StepNotFoundError(DurableAgentsError):
    """The run has no step with that id."""


class InvalidTransitionError(DurableAgentsError):
    """The run is not in a state that allows this operation."""


class BatchRefusedError(InvalidTransitionError):
    """Some runs of the batch cannot take the operation; nothing changed."""

    def __init__(self, message: str | None = None, *, problems: Iterable[str] = ()) -> None:
        # One entry per refused run (its id and why), so an operator fixes the whole batch at once.
        self.problems: list[str] = list(problems)
        super().__init__(message)


class LeaseLostError(DurableAgentsError):
    """Another worker holds this run's lease now; this worker's result was discarded."""


class StepError(DurableAgentsError):
    """A step failed."""


class RetryableError(StepError):
    """A transient step failure: it will be retried with backoff."""


class PermanentError(StepError):
    """A permanent step failure: the step fails without retrying."""


class ToolDefinitionError(DefinitionError):
    """The tool definition is invalid."""


class UnknownToolError(DurableAgentsError):
    """No tool is registered under that name."""


class ToolArgumentsError(InvalidInputError):
    """The tool arguments do not match the tool's schema."""

    def __init__(self, message: str | None = None, *, errors: Iterable[str] = ()) -> None:
        # One message per problem, each naming its path ("amount: expected number, got string"), so the
        # whole list can go back to the model at once instead of one fix per round trip.
        self.errors: list[str] = list(errors)
        if message is None and self.errors:
            message = f"{(self.__doc__ or '').strip().rstrip('.')}: {'; '.join(self.errors)}"
        super().__init__(message)


class EffectOutcomeUnknownError(PermanentError):
    """An external effect was invoked too often without a recorded outcome; an operator must decide."""


class EffectConflictError(RetryableError):
    """Another worker is applying the same effect right now; retry shortly."""


class ModelUnavailableError(RetryableError):
    """The model API could not answer now (connection, timeout, 429, 5xx, 529); the step retries.

    `capacity_wait`: nothing failed — the shared rate limit (MODEL_RATE_LIMITS) has no room until `retry_after`;
    the step waits that long without a worker, and the wait is not counted as an attempt.
    """

    def __init__(
        self,
        message: str | None = None,
        *,
        retry_after: float | None = None,
        status: int | None = None,
        capacity_wait: bool = False,
    ):
        super().__init__(message)
        self.retry_after = retry_after
        self.status = status
        self.capacity_wait = capacity_wait


class ModelRequestError(PermanentError):
    """The model API refused the request (400/401/403/404/413); fix the request or the credentials."""

    def __init__(self, message: str | None = None, *, status: int | None = None):
        super().__init__(message)
        self.status = status


class ModelRefusalError(PermanentError):
    """The model declined to continue (stop_reason "refusal"); the run stops for a human to look."""


class ContextWindowExceededError(PermanentError):
    """The conversation no longer fits the model's context window."""


class AgentLimitError(PermanentError):
    """The agent hit a bound (max_turns, or too many invalid tool calls) without finishing."""


class UnknownParticipantError(DurableAgentsError):
    """No participant is registered under that name."""


class NotificationFailedError(DurableAgentsError):
    """A notification could not be sent; it is tried again with backoff, then given up visibly."""


class DecisionLinkError(NotificationFailedError):
    """No decision link can be made: include durable_agents.urls in ROOT_URLCONF and sign with a SECRET_KEY of your
    own; meanwhile decide the wait in the admin or with `manage.py durable_decide`."""


class BrokerUnavailableError(DurableAgentsError):
    """The broker did not take the message; the run is kept in the database and the sweep wakes it later."""


class BudgetExceededError(PermanentError):
    """The run's token or cost budget is spent; raise it (durable_budget / the admin) and resume the run."""


class WaitNotFoundError(DurableAgentsError):
    """No wait has that id."""


class WaitClosedError(InvalidTransitionError):
    """The wait was already decided, expired or cancelled; nothing changed."""


class ApprovalRejectedError(DurableAgentsError):
    """A human rejected the action (or its deadline passed with the reject policy)."""


class WaitExpiredError(PermanentError):
    """The wait's deadline passed and its policy fails the run."""


class ChildRunFailedError(PermanentError):
    """A child run of a fail-fast fan-out failed or was cancelled."""


class ToolFailedError(DurableAgentsError):
    """The tool refused the call and changed nothing; an agent's model is told why and may try otherwise.

    Raise it from an external effectful tool to say "not applied": any other exception from such a tool
    leaves its outcome unknown, so the same call is retried under the same idempotency key.
    """


class ReplayDivergedError(PermanentError):
    """A replay reached what its recording cannot answer (a tool call it never made, a wait it never opened): the
    replay of that run ends here and the report counts it diverged. Give the replay a stub to answer the call."""


class ReplayBudgetExceededError(PermanentError):
    """The replay's token or cost budget is spent: its remaining runs stop before asking the model again."""


class ReplayAppliesNothingError(PermanentError):
    """A replay run tried to apply an effect or open a wait: refused, since a replay applies nothing."""


class CohortNotFoundError(DurableAgentsError):
    """No cohort has that name; `durable_replay --cohorts` lists them."""


class ReplayNotFoundError(DurableAgentsError):
    """No replay has that id."""
