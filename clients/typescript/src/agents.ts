// OpenAI Responses and Anthropic Messages over gRPC: tokenwire.v1.ResponsesService and
// tokenwire.v1.AnthropicService carry each API's exact JSON / SSE bytes in google.api.HttpBody.
// This module turns request objects into bodies, replies into objects (one JSON object, or one
// object per SSE event) and error bodies into the SDK's errors.
import { create } from "@bufbuild/protobuf";

import {
  DeadlineExceededError,
  GenerationError,
  NotFoundError,
  OverloadedError,
  TokenwireError,
  UnauthenticatedError,
  UnavailableError,
  ValidationError,
} from "./errors.js";
import { HttpBodySchema, type HttpBody } from "./gen/google/api/httpbody_pb.js";

/** A JSON object of either API (a request, a response, or one streamed event). */
export type JsonObject = Record<string, unknown>;

type ErrorClass = new (code: string, message: string) => TokenwireError;

// OpenAI error `code` / Anthropic error `type` (OpenAI `type`s as fallback) -> [status, class].
const BY_KIND: ReadonlyMap<string, [string, ErrorClass]> = new Map<string, [string, ErrorClass]>([
  ["invalid_request_error", ["INVALID_ARGUMENT", ValidationError]],
  ["invalid_api_key", ["UNAUTHENTICATED", UnauthenticatedError]],
  ["authentication_error", ["UNAUTHENTICATED", UnauthenticatedError]],
  ["not_found", ["NOT_FOUND", NotFoundError]],
  ["model_not_found", ["NOT_FOUND", NotFoundError]],
  ["not_found_error", ["NOT_FOUND", NotFoundError]],
  ["rate_limit_exceeded", ["RESOURCE_EXHAUSTED", OverloadedError]],
  ["rate_limit_error", ["RESOURCE_EXHAUSTED", OverloadedError]],
  ["service_unavailable", ["UNAVAILABLE", UnavailableError]],
  ["overloaded_error", ["UNAVAILABLE", UnavailableError]],
  ["timeout", ["DEADLINE_EXCEEDED", DeadlineExceededError]],
]);

/** The HttpBody of a JSON request (`stream` set when given). */
export function requestBody(body: JsonObject, stream?: boolean): HttpBody {
  const fields = stream === undefined ? body : { ...body, stream };
  return create(HttpBodySchema, {
    contentType: "application/json",
    data: new TextEncoder().encode(JSON.stringify(fields)),
  });
}

/** The error an OpenAI or Anthropic error object stands for (undefined: not an error). */
export function errorOf(reply: JsonObject): TokenwireError | undefined {
  let error = reply.error as JsonObject | undefined;
  if (typeof error !== "object" || error === null) {
    if (reply.type !== "error" || !("message" in reply)) return undefined;
    error = reply; // an OpenAI stream's `error` event is flat
  }
  const message = String(error.message ?? "error");
  for (const key of [error.code, error.type]) {
    const entry = typeof key === "string" ? BY_KIND.get(key) : undefined;
    if (entry !== undefined) return new entry[1](entry[0], message);
  }
  return new GenerationError("INTERNAL", message);
}

function parsed(data: Uint8Array): JsonObject {
  const reply = JSON.parse(new TextDecoder().decode(data)) as JsonObject;
  const error = errorOf(reply);
  if (error !== undefined) throw error;
  return reply;
}

/** The one JSON object of a non-stream answer; throws for an error body. */
export async function jsonReply(chunks: AsyncIterable<HttpBody>): Promise<JsonObject> {
  const parts: Uint8Array[] = [];
  for await (const chunk of chunks) parts.push(chunk.data);
  const data = new Uint8Array(parts.reduce((n, p) => n + p.length, 0));
  let at = 0;
  for (const part of parts) {
    data.set(part, at);
    at += part.length;
  }
  return parsed(data);
}

/** The events of a streamed answer (each with its `type`); an in-band error throws. */
export async function* sseEvents(chunks: AsyncIterable<HttpBody>): AsyncGenerator<JsonObject> {
  const decoder = new TextDecoder();
  let buffer = "";
  for await (const chunk of chunks) {
    if (chunk.contentType.startsWith("application/json")) parsed(chunk.data); // error before events
    buffer += decoder.decode(chunk.data, { stream: true });
    const blocks = buffer.split("\n\n");
    buffer = blocks.pop() ?? "";
    for (const block of blocks) {
      for (const line of block.split("\n")) {
        if (!line.startsWith("data: ") || line === "data: [DONE]") continue;
        const event = JSON.parse(line.slice(6)) as JsonObject;
        const error = errorOf(event);
        if (error !== undefined) throw error;
        yield event;
      }
    }
  }
}
