"""The API faces the server speaks, one module each: its request models,
how a request becomes the engine's `Generation`s (every face through the
same path: a chat-shaped `openai_requests.Call`), and how the results are
shaped back, finished or streamed.

  responses.py   OpenAI's Responses API (POST /v1/responses, stored
                 responses, previous_response_id)
  messages.py    Anthropic's Messages API (POST /v1/messages,
                 /v1/messages/count_tokens)
  tokens.py      vLLM's /tokenize and /detokenize

(TGI / LoRAX's native routes and OpenAI's completions and chat
completions are `serving.native`, `serving.openai_requests` and
`serving.openai_api`.)
"""
