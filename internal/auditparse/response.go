package auditparse

import "github.com/rabbitretry/rabbitretry/audit"

// SearchResponse is the body of the audit HTTP API's GET /v1/messages (its
// Arrival bodies are null): audit/httpapi writes it, auditctl writes and
// reads it.
type SearchResponse struct {
	Messages []audit.Message `json:"messages"`
	// Next is the after= cursor of the next page, "" on the last page.
	Next string `json:"next,omitempty"`
}
