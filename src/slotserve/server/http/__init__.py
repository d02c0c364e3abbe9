"""The HTTP side of the server: the FastAPI app (`app.create_app`) and its serving under
uvicorn (`serve.serve`), what the routes share (`state.ServerState`), the connections and their
limits (`connections`, `protocol`), API keys and the body limit (`security`), errors and
validation failures as OpenAI-shaped replies (`errors`, `validation`), and the engine
requests one HTTP request runs (`generation`)."""
