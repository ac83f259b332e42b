"""Flux.1 (dev and schnell) from prompt to image, following diffusers' ``FluxPipeline.__call__``::

    prompt ─ CLIPTokenizer (77) ─ text_encoder ─ pooler_output ───────────── pooled_projections ─┐
           └ T5 tokenizer (max_sequence_length, 512) ─ text_encoder_2 ─ encoder_hidden_states ──┤
    txt_ids = zeros [S, 3]; img_ids = (0, row, column) [h/2 * w/2, 3]                             │
    latents = pack(randn_tensor([1, 16, h, w], torch.Generator("cpu").manual_seed(seed)))         │
    dev: guidance = [scale] (the guidance embedding; no CFG, batch 1); schnell: none               │
    FlowMatchEulerDiscreteScheduler.set_timesteps(sigmas=linspace(1, 1/N, N), mu=shift(h*w/4)) ──┤
    for each timestep t:  v = transformer(latents, t / 1000, ...); latents = scheduler.step(v, t, latents)
    image = postprocess(vae_decoder(unpack(latents) / scaling_factor + shift_factor))

The text side runs once per prompt. The denoising loop is the fused step graph
(:mod:`onnxopt.pipeline.step_graph` without guidance: the transformer on ``t / 1000`` and the
Euler update ``latents + (sigma_next - sigma) * v`` in one graph) run by the loop every family
shares: host feeds on the CPU, bound buffers replayed as one captured CUDA graph per step on
CUDA. Without the fused step (``fused_step=False``, TensorRT) it is diffusers' own scheduler on
the host around the transformer's session. Each graph input is fed the type the graph declares
(``run_host``): optimum's int64 ids and diffusers' float32 ids alike. Flux's own computations are :mod:`onnxopt.pipeline.flux`.
"""

from __future__ import annotations

import time

import numpy as np

from onnxopt.pipeline import flux
from onnxopt.pipeline.plan import GenerationError
from onnxopt.pipeline.runner import (
    Pipeline,
    Result,
    _progress,
    _torch,
    check_numbers,
    check_prompts,
    check_request,
    check_sequence_length,
    clears_status,
    default_size,
)
from onnxopt.pipeline.sessions import run_host
from onnxopt.pipeline.text_outputs import run_outputs

VELOCITY = "out_hidden_states"


class FluxRunner(Pipeline):
    """A Flux ONNX folder loaded into ORT sessions (:meth:`Pipeline.load` makes one for a
    ``FluxPipeline`` folder); call it to generate an image."""

    def uses_guidance(self) -> bool:
        """Whether ``guidance`` changes the image: dev embeds it, schnell (no ``guidance`` input) ignores it."""
        return flux.takes_guidance(self._transformer_inputs(), self.folder.config("transformer"),
                                   self.folder.component("transformer").model)

    @clears_status
    def __call__(self, prompt: str, negative_prompt: str | None = None, steps: int = 28, guidance: float = 3.5,
                 scheduler: str | None = None, seed: int = 0, height: int | None = None, width: int | None = None,
                 controlnet_image=None, controlnet_scale=1.0, progress: bool = True, reuse=None,
                 max_sequence_length: int | None = None) -> Result:
        """One image, as diffusers' FluxPipeline makes it with the same arguments
        (``guidance_scale=guidance``, ``num_inference_steps=steps``, ``generator`` seeded with ``seed``).
        ``guidance``: dev's embedded guidance (schnell has none: the value is unused, as in diffusers).
        ``max_sequence_length``: T5's prompt length in tokens (default 512). Flux runs no CFG: a
        negative prompt is refused, as are ControlNet images and step reuse."""
        folder = self.folder
        if controlnet_image is not None or reuse:
            raise GenerationError(f"{folder.root} is a Flux pipeline: no ControlNet image or step reuse")
        if negative_prompt is not None:
            raise GenerationError("Flux embeds its guidance and runs no classifier-free guidance: it takes no negative "
                                  "prompt")
        scheduler = check_request(folder, steps=steps, scheduler=scheduler)
        check_numbers(guidance=guidance, seed=seed)
        check_prompts(prompt, None)
        sequence = flux.T5_SEQUENCE if max_sequence_length is None else max_sequence_length
        check_sequence_length(folder, sequence)
        factor = folder.vae_scale_factor
        default_h, default_w = default_size(folder)
        height, width = height or default_h, width or default_w
        flux.check_image_size(height, width, factor)
        self._latent_hw = flux.latent_size(height, width, factor)
        embeds_guidance = self.uses_guidance()
        scaling, shift = flux.vae_factors(folder.config("vae_decoder"), folder.component("vae_decoder").folder)

        timings: dict = {"provider": self.provider, "step": self.step_source if self.fused_step else
                         f"unfused: {folder.denoiser}/model.onnx and diffusers' step",
                         "cuda_graph": self.cuda_graph and self.fused_step, "session_runs_per_step": 1,
                         "classifier_free_guidance": False,
                         "guidance_embedding": embeds_guidance}
        start = time.perf_counter()
        t0 = time.perf_counter()
        cond = self.encode_flux_prompt(prompt, sequence)
        timings["text_encoder_s"] = time.perf_counter() - t0
        timings["text_encoders"] = dict(self.text_sources)
        cond["img_ids"] = flux.image_ids(*self._latent_hw)
        if embeds_guidance:
            cond["guidance"] = flux.guidance_feed(guidance)
        channels = self._latent_channels() // 4  # the packed width, checked against the graph's
        latents = flux.initial_latents(seed, channels, *self._latent_hw)
        if self.fused_step:
            latents = self._denoise_fused(scheduler, steps, latents, cond, progress, timings)
        else:
            latents = self._denoise_flux(self._scheduler(scheduler), steps, latents, cond, progress, timings)
        every = self._decode(latents, guidance, timings)  # [1, H, W, 3]
        timings["total_s"] = time.perf_counter() - start
        timings["rest_s"] = timings["total_s"] - sum(timings.get(k, 0.0) for k in (
            "text_encoder_s", "steps_s", "vae_decode_s"))
        timings["session_creation_s"] = self.creation_s
        if self.calls == 0:
            timings["cold_start_s"] = self.creation_s + timings["total_s"]
        self.calls += 1
        return Result(latents=latents, pixels=every[0], timings=timings, all_pixels=every)

    def encode_flux_prompt(self, prompt: str, max_sequence_length: int) -> dict[str, np.ndarray]:
        """pooled_projections (CLIP-L's pooler_output), encoder_hidden_states (T5's last_hidden_state
        over ``max_sequence_length`` tokens) and txt_ids, for one prompt."""
        clip_ids = self._token_ids("tokenizer", [prompt])
        clip = run_host(self.text_session("text_encoder", 1), {"input_ids": clip_ids})
        if "pooler_output" not in clip:
            raise GenerationError(f"{self.folder.component('text_encoder').model}: CLIP-L has no pooler_output output "
                                  f"(it has {', '.join(clip)})")
        t5_ids = flux.t5_token_ids(self.tokenizers["tokenizer_2"], prompt, max_sequence_length)
        (hidden,) = run_outputs(self._t5_session(), t5_ids, ["last_hidden_state"])
        return {"pooled_projections": clip["pooler_output"].astype(np.float32),
                "encoder_hidden_states": hidden.astype(np.float32), "txt_ids": flux.text_ids(hidden.shape[1])}

    def _t5_session(self):
        if "text_encoder_2" not in self.sessions:
            self.sessions["text_encoder_2"] = self._open_once("text_encoder_2")
        return self.sessions["text_encoder_2"]

    def _transformer_inputs(self) -> list[str]:
        """The transformer graph's input names: its own session's where the unfused loop runs it, else
        its file's, read without the weights (the fused step never opens the transformer's own
        session, which would load every weight a second time)."""
        if not self.fused_step or "transformer" in self.sessions:
            return [spec.name for spec in self._transformer().get_inputs()]
        if getattr(self, "_graph_inputs", None) is None:
            import onnx

            graph = onnx.load(str(self.folder.component("transformer").model), load_external_data=False).graph
            initializers = {tensor.name for tensor in graph.initializer}
            self._graph_inputs = [value.name for value in graph.input if value.name not in initializers]
        return self._graph_inputs

    def _transformer(self):
        """The transformer's own session (made at load by the plan's unfused entry, else on first use)."""
        if "transformer" not in self.sessions:
            self.sessions["transformer"] = self._open_once("transformer")
        return self.sessions["transformer"]

    def _denoise_fused(self, name: str, steps: int, latents: np.ndarray, cond: dict, progress: bool, timings: dict):
        """The fused step's loop (the UNet and SD3 families' own: host feeds, or bound buffers
        captured as CUDA graphs) on FlowMatchEulerDiscreteScheduler's plan for this image's size."""
        from onnxopt.pipeline.schedulers import SchedulerError

        self._latent_size = self._latent_hw  # the plan's dynamic shifting reads it
        try:
            plan = self._plan(name, self._scheduler(name), steps)
        except SchedulerError as exc:  # e.g. stochastic_sampling: diffusers' own step on the host, as the UNets do
            timings["step"] = f"unfused: {exc}"
            return self._denoise_flux(self._scheduler(name), steps, latents, cond, progress, timings)
        self.status.done()
        bar = _progress(len(plan), progress)
        # guidance_scale: read by no node of a step graph without classifier-free guidance
        result = self._fused_loop(plan, _torch().from_numpy(latents), cond, None, 1.0, frozenset(), bar, timings)
        bar.close()
        timings["unet_steps"] = timings["steps"]
        return result

    def _denoise_flux(self, sched, steps: int, latents: np.ndarray, cond: dict, progress: bool, timings: dict):
        """diffusers' loop: the transformer on t / 1000, FlowMatchEulerDiscreteScheduler's own step."""
        from onnxopt.pipeline.schedulers import _set_timesteps, flow_match_timestep_kwargs

        torch = _torch()
        transformer = self._transformer()
        _set_timesteps(sched, steps, flow_match_timestep_kwargs("flux", dict(sched.config), steps, *self._latent_hw))
        sched.set_begin_index(0)
        self.status.done()
        bar = _progress(len(sched.timesteps), progress)
        sample = torch.from_numpy(latents)
        step_times = []
        for t in sched.timesteps:
            t1 = time.perf_counter()
            timestep = (t.expand(1).to(torch.float32) / 1000).numpy()  # diffusers: timestep / 1000 in the latents' type
            velocity = run_host(transformer, dict(cond, hidden_states=sample.numpy(), timestep=timestep))[VELOCITY]
            sample = sched.step(torch.from_numpy(velocity.astype(np.float32)), t, sample, return_dict=False)[0]
            step_times.append(time.perf_counter() - t1)
            bar.update()
        bar.close()
        timings["first_step_s"] = step_times[0]
        timings["step_mean_s"] = float(np.mean(step_times[1:])) if len(step_times) > 1 else step_times[0]
        timings["steps_s"] = float(np.sum(step_times))
        timings["steps"] = timings["unet_steps"] = len(step_times)
        return sample.numpy()

    def _unscale(self, latents: np.ndarray) -> np.ndarray:
        """The VAE decoder's input: unpacked, / scaling_factor + shift_factor (the folder's VAE config)."""
        scaling, shift = flux.vae_factors(self.folder.config("vae_decoder"), self.folder.component("vae_decoder").folder)
        return flux.vae_input(latents, *self._latent_hw, scaling, shift)

