// Typed errors for the gRPC statuses (and in-band stream errors) of the tokenwire API. The client
// never lets a raw ConnectError out: callers handle one hierarchy.
import { Code, ConnectError } from "@connectrpc/connect";

/** Base class of every error the SDK raises for a failed call. */
export class TokenwireError extends Error {
  /** gRPC status name, e.g. "INVALID_ARGUMENT". */
  readonly code: string;
  /** The server's message (without the status prefix). */
  readonly rawMessage: string;

  constructor(code: string, message: string, options?: { cause?: unknown }) {
    super(message ? `${code}: ${message}` : code, options);
    this.name = new.target.name;
    this.code = code;
    this.rawMessage = message;
  }
}

/** A request parameter is invalid (INVALID_ARGUMENT); the message names the field and limit. */
export class ValidationError extends TokenwireError {}
/** The server does not do what was asked (UNIMPLEMENTED). */
export class UnsupportedError extends ValidationError {}
/** Too many requests in flight (RESOURCE_EXHAUSTED): retry later. */
export class OverloadedError extends TokenwireError {}
/** Missing or wrong API key (UNAUTHENTICATED). */
export class UnauthenticatedError extends TokenwireError {}
/** The named thing is not there, e.g. a stored Response (NOT_FOUND). */
export class NotFoundError extends TokenwireError {}
/** The API key may not make this call (PERMISSION_DENIED). */
export class PermissionDeniedError extends TokenwireError {}
/** Server unreachable, not ready, or a shard is down (UNAVAILABLE). */
export class UnavailableError extends TokenwireError {}
/** The call's deadline (timeoutMs) passed before it finished (DEADLINE_EXCEEDED). */
export class DeadlineExceededError extends TokenwireError {}
/** The call was cancelled, e.g. through its AbortSignal (CANCELLED). */
export class CancelledError extends TokenwireError {}
/** The model server failed while generating (INTERNAL, or an in-band "generation" error). */
export class GenerationError extends TokenwireError {}

type ErrorClass = new (code: string, message: string, options?: { cause?: unknown }) => TokenwireError;

// Connect's Code -> [gRPC status name, class]. Codes not listed give a plain TokenwireError.
const BY_CODE: ReadonlyMap<Code, [string, ErrorClass]> = new Map<Code, [string, ErrorClass]>([
  [Code.InvalidArgument, ["INVALID_ARGUMENT", ValidationError]],
  [Code.OutOfRange, ["OUT_OF_RANGE", ValidationError]],
  [Code.FailedPrecondition, ["FAILED_PRECONDITION", ValidationError]],
  [Code.Unimplemented, ["UNIMPLEMENTED", UnsupportedError]],
  [Code.ResourceExhausted, ["RESOURCE_EXHAUSTED", OverloadedError]],
  [Code.Unauthenticated, ["UNAUTHENTICATED", UnauthenticatedError]],
  [Code.PermissionDenied, ["PERMISSION_DENIED", PermissionDeniedError]],
  [Code.NotFound, ["NOT_FOUND", NotFoundError]],
  [Code.Unavailable, ["UNAVAILABLE", UnavailableError]],
  [Code.DeadlineExceeded, ["DEADLINE_EXCEEDED", DeadlineExceededError]],
  [Code.Canceled, ["CANCELLED", CancelledError]],
  [Code.Internal, ["INTERNAL", GenerationError]],
]);

// In-band `error_type` of a failed stream (see GenerateStreamResponse) -> [status name, class].
const BY_ERROR_TYPE: ReadonlyMap<string, [string, ErrorClass]> = new Map<string, [string, ErrorClass]>([
  ["validation", ["INVALID_ARGUMENT", ValidationError]],
  ["overloaded", ["RESOURCE_EXHAUSTED", OverloadedError]],
  ["unauthenticated", ["UNAUTHENTICATED", UnauthenticatedError]],
  ["unavailable", ["UNAVAILABLE", UnavailableError]],
  ["deadline", ["DEADLINE_EXCEEDED", DeadlineExceededError]],
  ["generation", ["INTERNAL", GenerationError]],
]);

/** Turns whatever a call threw into a TokenwireError (ConnectErrors by their code). */
export function translateError(error: unknown): TokenwireError {
  if (error instanceof TokenwireError) {
    return error;
  }
  const connectError = ConnectError.from(error);
  const entry = BY_CODE.get(connectError.code);
  if (entry === undefined) {
    const name = Code[connectError.code]?.replace(/([a-z])([A-Z])/g, "$1_$2").toUpperCase() ?? "UNKNOWN";
    return new TokenwireError(name, connectError.rawMessage, { cause: error });
  }
  const [name, ErrorType] = entry;
  return new ErrorType(name, connectError.rawMessage, { cause: error });
}

/** The error of an in-band error event (`error_type`, `error`). */
export function inBandError(errorType: string | undefined, message: string): TokenwireError {
  const [name, ErrorType] = BY_ERROR_TYPE.get(errorType ?? "") ?? ["INTERNAL", GenerationError];
  return new ErrorType(name, message);
}
