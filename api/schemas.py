"""Wire formats: WebSocket events, session REST bodies and the OpenAI-compatible bodies.

WebSocket protocol (`/v1/chat/ws`, one JSON object per text frame, each with a ``type``):

client → server
  ``auth``            {api_key}                          only when the server has API keys and the
                                                         handshake carried none (no ``Authorization``
                                                         header, no ``?api_key=``): the first frame
  ``session.create``  {mode?, budget?, system?}         start a session on this connection
  ``session.resume``  {session_id, token?}               bind an existing session (token required
                                                         when the server issued one)
  ``message``         {content, max_tokens?, temperature?, top_p?, top_k?, min_p?, repetition_penalty?,
                       frequency_penalty?, presence_penalty?, stop?, seed?, idempotency_key?}
                                                         values left out: the server's defaults
                                                         the same key sent again gets the finished
                                                         turn's answer, not a second run
  ``cancel``          {}                                 stop the reply being generated (answered by its
                                                         ``done``; with none under way: ``no_active_turn``)
server → client
  ``authenticated``  {}                                  the ``auth`` frame was accepted
  ``session``  {session_id, token, mode, budget, replica}
  ``delta``    {text}
  ``done``     {finish_reason, usage{prompt_tokens, prefilled_tokens, generated_tokens},
                memory{device_bytes, host_bytes, redis_bytes, readmitted_tokens, ...}, replica,
                memory_map{device, host, redis, readmitted, ...} (docs/observability.md),
                storage{saved, durable, durability, replicas} (what the turn's save gave),
                sampling{temperature, top_p, top_k, ..., seed} (what the reply was drawn with), ...}
  ``error``    {code, message}; the connection stays open, except after ``unauthorized``
               (closed with code 4401).

Error codes besides the engine's (``session_not_found``, ``session_busy``, ``empty_message``,
``message_too_large``, ``max_tokens_too_large``, ``invalid_sampling_params``, ``unknown_mode``,
``context_length_exceeded``): ``invalid_json`` (frame is not a JSON object, or not UTF-8),
``invalid_event`` (fields missing or of the wrong type), ``unknown_type`` (no such event type),
``no_session`` (message before create/resume), ``no_active_turn`` (cancel with no turn under
way), ``unauthorized`` (missing or wrong API key),
``rate_limited`` (frame over the connection's rate; dropped), ``too_many_sessions`` (the replica
is full), ``replica_unavailable`` (the replica died mid-turn; the next turn resumes from the last
saved state), ``internal_error``. README's error table lists them all with their HTTP statuses.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, TypeAdapter, model_validator


def unicode_text(value: str) -> str:
    """JSON's ``\\ud800`` escapes make strings no tokenizer (or UTF-8 encoder) accepts: refuse them here."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("not valid Unicode text (a lone surrogate)") from None
    return value


Text = Annotated[str, AfterValidator(unicode_text)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


# --- WebSocket: client events -----------------------------------------------------------------
class Auth(_Strict):
    type: Literal["auth"]
    api_key: str = Field(description="One of the server's API keys (RKV_API_KEY).")


class SessionCreate(_Strict):
    type: Literal["session.create"]
    mode: str | None = Field(None, description="Cache mode (full, snapkv, rocketkv, ...); default: the server's.")
    budget: int | None = Field(None, description="RocketKV token budget; default: the server's.")
    system: Text | None = Field(None, description="Optional system prompt.")


class SessionResume(_Strict):
    type: Literal["session.resume"]
    session_id: str
    token: str | None = Field(None, description="The secret returned when the session was created.")


class SamplingFields(BaseModel):
    """The sampling values a turn may send (range-checked by the engine: ``invalid_sampling_params``);
    each one left out takes the server's default (README: Sampling)."""

    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    seed: int | None = None

    def sampling(self) -> dict[str, Any]:
        """The values sent (None: left to the server)."""
        return {k: getattr(self, k) for k in SamplingFields.model_fields if getattr(self, k) is not None}


class UserMessage(_Strict, SamplingFields):
    type: Literal["message"]
    content: Text
    stop: list[Text] | None = None
    # The same key on a message sent again (after a lost connection) gets the finished turn's
    # answer instead of a second run; without one, the server makes one per message.
    idempotency_key: str | None = Field(None, min_length=1, max_length=128)


class Cancel(_Strict):
    type: Literal["cancel"]


ClientEvent = Annotated[Union[Auth, SessionCreate, SessionResume, UserMessage, Cancel], Field(discriminator="type")]
client_event_adapter: TypeAdapter[ClientEvent] = TypeAdapter(ClientEvent)
CLIENT_EVENT_TYPES = frozenset({"auth", "session.create", "session.resume", "message", "cancel"})


# --- WebSocket: server events -----------------------------------------------------------------
class AuthenticatedEvent(BaseModel):
    type: Literal["authenticated"] = "authenticated"


class UsageModel(BaseModel):
    prompt_tokens: int = Field(description="Whole history at the start of the turn, new message included.")
    prefilled_tokens: int = Field(description="Tokens this turn fed through the model before decoding.")
    generated_tokens: int


class MemoryModel(BaseModel):
    device_bytes: int = 0
    host_bytes: int = 0
    redis_bytes: int = 0
    readmitted_tokens: int = 0
    history_tokens: int = 0
    device_tokens: int = 0
    cold_bytes_read: int = Field(0, description="Bytes of cold pages the last turn read back (host tier and Redis).")
    redis_bytes_read: int = Field(0, description="The part of cold_bytes_read that came from Redis.")
    digest_bytes_read: int = Field(0, description="Bytes of cold-page key digests the last turn scored.")
    bytes_demoted: int = Field(0, description="Bytes of pages the last turn wrote from the device to the host tier.")
    redis_bytes_written: int = Field(0, description="Bytes the last turn wrote to Redis for this session.")


class MapSummaryModel(BaseModel):
    """The memory map in numbers: token slots (one position of one layer and one KV head) per state,
    and the slots the last turn re-admitted and demoted (docs/observability.md)."""

    layers: int = 0
    kv_heads: int = 0
    positions: int = Field(0, description="Tokens of the conversation (the map's width).")
    device: int = 0
    host: int = 0
    redis: int = 0
    evicted: int = Field(0, description="Dropped for good (snapkv, rocketkv).")
    unfed: int = Field(0, description="Not fed to the cache yet (the next turn prefills them).")
    lost: int = Field(0, description="Cold pages no tier holds (the next turn rebuilds the cache).")
    readmitted: int = 0
    demoted: int = 0


class StorageModel(BaseModel):
    """What the turn's save gave (README: What a client can rely on)."""

    saved: bool = Field(description="The session's record in Redis holds the turn: any replica restores it.")
    durable: bool = Field(description="A crash of the Redis primary does not lose it either.")
    durability: Literal["none", "memory", "fsync", "replicated"] = Field(
        description="`none`: not saved (kept in this replica's memory, saved once Redis takes it); `memory`: in "
        "Redis's memory only; `fsync`: Redis fsyncs every write; `replicated`: Redis replicas took it.")
    replicas: int = Field(0, description="Redis replicas that acknowledged the save (with RKV_REDIS_MIN_REPLICAS).")


class SessionEvent(BaseModel):
    type: Literal["session"] = "session"
    session_id: str
    token: str
    mode: str
    budget: int | None = None
    replica: str
    restored: bool = Field(False, description="The session was rebuilt from the store on this replica.")
    sampling: dict[str, float | int] | None = Field(
        None, description="What a turn that sends no sampling values is drawn with (the server's defaults).")


class DeltaEvent(BaseModel):
    type: Literal["delta"] = "delta"
    text: str


class StatusEvent(BaseModel):
    """Progress before the reply's first delta, where the turn first does work that takes a while."""

    type: Literal["status"] = "status"
    stage: str = Field(description="`replay`: the session's lost cache is rebuilt by feeding its earlier turns again.")
    done: int = Field(description="Units of the stage done so far (replay: turns replayed).")
    total: int = Field(description="Units of the whole stage (replay: turns to replay).")
    tokens: int = Field(0, description="Tokens fed so far.")
    total_tokens: int = Field(0, description="Tokens the stage feeds in all.")


class DoneEvent(BaseModel):
    type: Literal["done"] = "done"
    finish_reason: str
    usage: UsageModel
    memory: MemoryModel
    replica: str
    session_id: str
    ttft_ms: float = 0.0
    latency_ms: float = 0.0
    memory_map: MapSummaryModel | None = Field(
        None, description="Where the session's tokens are after the turn (GET /v1/sessions/{id}/memory-map in full)."
    )
    storage: StorageModel | None = Field(None, description="What the turn's save gave; absent without Redis.")
    sampling: dict[str, float | int | None] | None = Field(
        None, description="What the reply was drawn with (absent for a turn answered again).")


class ErrorEvent(BaseModel):
    type: Literal["error"] = "error"
    code: str
    message: str


ServerEvent = Annotated[
    Union[AuthenticatedEvent, SessionEvent, StatusEvent, DeltaEvent, DoneEvent, ErrorEvent], Field(discriminator="type")
]
server_event_adapter: TypeAdapter[ServerEvent] = TypeAdapter(ServerEvent)


# --- Session REST ----------------------------------------------------------------------------
class CreateSessionRequest(_Strict):
    mode: str | None = None
    budget: int | None = None
    system: Text | None = None


class SessionInfo(BaseModel):
    """What creating, importing or resuming a session returns; ``token`` is needed for later calls."""

    session_id: str
    token: str
    mode: str
    budget: int | None = None
    replica: str
    restored: bool = False
    sampling: dict[str, float | int] | None = Field(
        None, description="What a turn that sends no sampling values is drawn with (the server's defaults).")


class TokenCounts(BaseModel):
    history: int = Field(description="Tokens of the whole conversation.")
    cached: int = Field(description="Tokens the KV cache has been fed (the rest is prefilled next turn).")
    device: int = Field(description="Tokens whose KV is on the device after compression.")


class TurnModel(BaseModel):
    prompt_tokens: int
    prefilled_tokens: int
    generated_tokens: int
    finish_reason: str
    ttft_ms: float
    latency_ms: float


class SessionSummary(BaseModel):
    session_id: str
    mode: str
    budget: int | None = None
    turns: int
    history_tokens: int
    created_at: float
    last_used: float
    replica: str | None = Field(None, description="Replica holding the session in memory; None if only stored.")


class SessionDetail(SessionSummary):
    messages: list[dict[str, Any]]
    tokens: TokenCounts
    memory: MemoryModel
    turn_stats: list[TurnModel]
    busy: bool


class MapRow(BaseModel):
    layer: int
    head: int = Field(description="KV head.")
    runs: list[int] = Field(description="[state, length, state, length, ...]: positions 0..positions-1 in order; "
                                        "a state is an index into ``states``.")
    readmitted: list[int] = Field(description="[start, length, ...]: positions the last turn brought back to the device.")
    demoted: list[int] = Field(description="[start, length, ...]: positions the last turn made cold.")


class MessageSpan(BaseModel):
    role: str = Field(description="user, assistant, or history (imported messages, no turn figures).")
    message: int | None = Field(description="Index into the session's messages; None for history.")
    start: int
    end: int = Field(description="One past the span's last position.")


class MemoryMap(BaseModel):
    """Where every token of the session is, per layer and KV head, run-length encoded
    (docs/observability.md)."""

    session_id: str
    mode: str
    held: bool = Field(description="The cache is on the device (false: parked, or not rebuilt yet).")
    encoding: Literal["rle/1"]
    states: list[str]
    fed: int = Field(description="Positions fed to the cache; the rest are unfed.")
    rows: list[MapRow]
    summary: MapSummaryModel
    messages: list[MessageSpan]
    tokens: list[str] | None = Field(None, description="Each position's token decoded alone (with ?text=true).")


class SessionList(BaseModel):
    sessions: list[SessionSummary]


EXPORT_FORMAT = "rocketkv-mt.session/1"


class SessionExport(BaseModel):
    """A portable session: importing it rebuilds the KV cache by prefilling on the next turn."""

    model_config = ConfigDict(extra="ignore")

    format: Literal["rocketkv-mt.session/1"] = EXPORT_FORMAT
    mode: str | None = None
    budget: int | None = None
    messages: list[dict[str, Any]] = Field(default_factory=list)
    token_ids: list[int] | None = Field(
        None, description="The conversation as the model saw it; omitted means re-render from the messages."
    )
    session_id: str | None = Field(None, description="Id at export time (informational; import assigns a new one).")


class ErrorDetail(BaseModel):
    code: str
    message: str
    type: str = "invalid_request_error"
    param: str | None = None


class ErrorBody(BaseModel):
    error: ErrorDetail


class RedisHealth(BaseModel):
    ok: bool
    error: str | None = Field(None, description="The last Redis error, while Redis is unreachable.")


class Health(BaseModel):
    """Always HTTP 200 while the process serves: ``degraded`` means chatting works but Redis does not."""

    status: Literal["ok", "degraded"] = "ok"
    replica: str
    model: str
    backend: str
    redis: RedisHealth | None = Field(None, description="Present when the server is configured with Redis.")
    unsaved_sessions: int | None = Field(
        None, description="Sessions whose latest state is not in Redis yet (saved when Redis is back)."
    )


# --- OpenAI-compatible -----------------------------------------------------------------------
class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[dict[str, Any]] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.get("text", "") for part in self.content if part.get("type") == "text")

    @model_validator(mode="after")
    def _text_parts(self) -> "ChatMessage":
        if isinstance(self.content, list) and any(
            p.get("type") == "text" and not isinstance(p.get("text", ""), str) for p in self.content
        ):
            raise ValueError("a text part needs a string 'text'")
        unicode_text(self.text())
        return self


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: bool = False


class ChatCompletionRequest(SamplingFields):
    # Unknown OpenAI parameters (user, logit_bias, ...) are accepted and ignored, as clients send them
    # freely; top_k, min_p and repetition_penalty are extensions (vLLM's and llama.cpp's names).
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    model: str
    messages: list[ChatMessage] = Field(min_length=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_completion_tokens: int | None = None
    stop: Text | list[Text] | None = None
    n: int = 1
    mode: str | None = Field(None, description="Cache mode of a new session (extension).")
    budget: int | None = Field(None, description="Token budget of a new session (extension).")


class CompletionUsage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prefilled_tokens: int = Field(description="Prompt tokens actually prefilled (the rest came from the cache).")


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class Choice(BaseModel):
    index: int = 0
    message: AssistantMessage
    finish_reason: str


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[Choice]
    usage: CompletionUsage
    session_id: str
    replica: str
    storage: StorageModel | None = Field(None, description="What the turn's save gave; absent without Redis.")


class ChunkDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChunkChoice(BaseModel):
    index: int = 0
    delta: ChunkDelta
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: CompletionUsage | None = None
    storage: StorageModel | None = Field(None, description="On the chunk that finishes the reply: what its save gave.")


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "rocketkv-mt"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
