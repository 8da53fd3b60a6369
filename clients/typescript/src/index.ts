// @tokenwire/client: TypeScript client for the tokenwire text-generation server.
export { createClient, SERVED_MODEL } from "./client.js";
export type {
  CallOptions,
  ChatMessageInit,
  ChatParameters,
  CompletionParameters,
  ClientOptions,
  GenerateParameters,
  GrammarInit,
  Prompt,
  TokenwireClient,
} from "./client.js";
export { imageFromFile, type ContentPartInput, type ImageInput, type PromptPart } from "./images.js";
export type { JsonObject } from "./agents.js";
export {
  CancelledError,
  DeadlineExceededError,
  GenerationError,
  NotFoundError,
  OverloadedError,
  PermissionDeniedError,
  TokenwireError,
  UnauthenticatedError,
  UnavailableError,
  UnsupportedError,
  ValidationError,
} from "./errors.js";
// Generated message types and schemas, for users who want the raw Connect-ES client.
export * from "./gen/tokenwire/v1/generate_pb.js";
export * from "./gen/tokenwire/v1/openai_pb.js";
export * from "./gen/tokenwire/v1/responses_pb.js";
export * from "./gen/tokenwire/v1/anthropic_pb.js";

/** Version of this package; it goes with the tokenwire server of the same version. */
export const VERSION = "0.1.0";
