"""The API faces the server speaks, one module each: its request models,
how a request becomes the engine's `Generation`s, and how the results are
shaped back, finished or streamed (`serving.sse` writes the streams).
Every OpenAI and Anthropic face goes through the same path, a chat-shaped
`openai_requests.Call`; every face ends in the same `Generation`.

  native.py           TGI / LoRAX (POST /, /generate, /generate_stream)
  openai_requests.py  OpenAI's completions and chat completions: bodies
                      parsed into `Call`s (the chat path the others use)
  openai_api.py       ... and their responses, finished and streamed
  responses.py        OpenAI's Responses API (POST /v1/responses, stored
                      responses, previous_response_id)
  messages.py         Anthropic's Messages API (POST /v1/messages,
                      /v1/messages/count_tokens)
  tokens.py           vLLM's /tokenize and /detokenize
"""
