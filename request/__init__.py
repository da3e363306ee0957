"""The pure parts of building a model request: the prompt and its anchors
(:mod:`~aalis_agent.request.prompt`), token counting (``tokens``), the five-step trim
(``trim``) and tool-call pairing (``pairing``), ``token:usage`` accounting (``usage``),
text normalisation and truncation (``textnorm``), the limits of what the log can hold
(``limits``), the providers' message rules (``validate``), and the texts the model and
logs see (``texts``, ``labels``). No I/O, no threads; the actors put them together
(:mod:`aalis_agent.actors.request`)."""
