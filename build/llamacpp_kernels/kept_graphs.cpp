// specgate patch: one graph per recent decode shape, each with the scheduler that allocated it.
//
// llama.cpp reuses the last decode's graph when the next decode has its shape. Speculative decoding
// alternates shapes (a plain step of 1 token, then a verification of 1 + k), and each change built
// and allocated a graph again: 0.3-0.4 ms of a 2.5-3 ms decode on a 2-core Xeon. Here a decode of
// at most SPECGATE_KEPT_MAX_TOKENS tokens runs on a scheduler of its own shape, kept with its graph
// and compute buffer after other shapes come, up to SPECGATE_KEPT_GRAPHS of them (least recently
// used first out); a decode whose shape a kept graph fits takes that graph and scheduler back,
// exactly as upstream reuses the last one (the same can_reuse test; set_inputs writes the new
// ubatch's inputs). A kept graph's compute buffer is its own, so nothing another graph computes can
// touch it. Longer decodes (prompt chunks, each a shape of its own) build in place on the context's
// own scheduler, whose buffer was reserved for the largest ubatch: on a fresh scheduler each would
// allocate and fault in its buffer again (25-30 ms a prompt, measured).
// CPU-only contexts without pipeline parallelism: there a compute buffer is host memory.
// 16: the calibration's 10 verification sizes and the plain step stay kept while it measures.
static constexpr size_t   SPECGATE_KEPT_GRAPHS     = 16;
static constexpr uint32_t SPECGATE_KEPT_MAX_TOKENS = 64;

bool llama_context::specgate_switch_graph(const llm_graph_params & gparams) {
    auto & slot = gf_res_prev[n_outputs > 0];
    if (backend_ptrs.size() != 1 || cparams.pipeline_parallel || !slot || !gf_res_reserve) {
        return false;
    }
    const bool active = gf_res_prev_active == slot.get();
    if (active && slot->can_reuse(gparams)) {
        return false; // upstream's own reuse of the last graph
    }
    const bool at_home = !specgate_home.sched; // the context's own scheduler is the one in use
    specgate_kept_graph incoming;
    bool reuse = false;
    if (gparams.ubatch.n_tokens > SPECGATE_KEPT_MAX_TOKENS) {
        if (at_home) {
            return false; // build in place, as upstream does
        }
        incoming = std::move(specgate_home);
    } else {
        size_t i = 0;
        while (i < specgate_graphs.size() && !specgate_graphs[i].res->can_reuse(gparams)) {
            ++i;
        }
        if (i < specgate_graphs.size()) {
            incoming = std::move(specgate_graphs[i]);
            specgate_graphs.erase(specgate_graphs.begin() + i);
            reuse = true;
        } else if (!at_home && !active) {
            return false; // the kept scheduler in use holds no valid graph: build in place
        } else if (specgate_graphs.size() >= SPECGATE_KEPT_GRAPHS) {
            // the least recently used graph goes; its result and scheduler serve the new one
            incoming = std::move(specgate_graphs.front());
            specgate_graphs.erase(specgate_graphs.begin());
        } else {
            incoming.res.reset(new llm_graph_result(gf_res_reserve->get_max_nodes()));
            incoming.sched.reset(ggml_backend_sched_new(backend_ptrs.data(), backend_buft.data(), backend_ptrs.size(),
                                                        gf_res_reserve->get_max_nodes(), false, cparams.op_offload));
        }
    }
    specgate_kept_graph outgoing = {std::move(slot), std::move(sched)};
    if (at_home) {
        specgate_home = std::move(outgoing);
    } else if (active) {
        specgate_graphs.push_back(std::move(outgoing)); // the most recently used
        if (specgate_graphs.size() > SPECGATE_KEPT_GRAPHS) {
            specgate_graphs.erase(specgate_graphs.begin());
        }
    } // else: a kept scheduler without a valid graph, dropped
    slot  = std::move(incoming.res);
    sched = std::move(incoming.sched);
    gf_res_prev_active = reuse ? slot.get() : nullptr;
    return true;
}

